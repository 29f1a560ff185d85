"""Checkpoints in torch's own format (DCP) written by FSDP2, loaded by ``fabric.load`` under HorovodStrategy.

Two processes under ``torch.distributed.run`` train a small GPT with ``fully_shard`` and save it with
``dcp.save`` (tests/workers/dcp_interop.py); four Horovod workers on two emulated nodes then load the directory
into a model and AdamW set up unsharded, with ZeRO-1 and with ZeRO-3, and take a step from it; the Trainer reads
it through ``ckpt_path=`` under ZeRO-3 for ``validate`` and ``fit``. A one-process Trainer's checkpoint laid out
as Lightning's ``FSDPStrategy(state_dict_type="sharded")`` writes it (Lightning's FSDP needs a GPU) resumes under
ZeRO-3 where it stopped, equal to the one process resuming from its own file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hvd_launch import TWO_NODES, WORKERS, run_job

from hvd_plugins.testing.launch import run_bounded

COVERS = (
    "hvd_plugins.core.dcp_read",
    "hvd_plugins.fabric.strategies.horovod",
    "hvd_plugins.fabric.strategies.shared",
    "hvd_plugins.pytorch.strategies.horovod",
)
"""The modules these real jobs exercise beyond their unit files."""

SHARD_MODES = ("none", "optimizer", "parameters")
EXACT = 0.0
TOLERANCE = 1e-6


def test_an_fsdp2_dcp_checkpoint_loads_at_another_world_size_in_every_shard_mode_and_through_ckpt_path(
    tmp_path: Path,
) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(WORKERS / "dcp_interop.py"), "--write", "--out", str(tmp_path)]
    written = run_bounded(command, 300, out_dir=tmp_path, cwd=WORKERS)
    assert (tmp_path / "fsdp2" / ".metadata").is_file(), written.output[-3000:]
    one_process = [sys.executable, str(WORKERS / "dcp_interop.py"), "--write-lightning", "--out", str(tmp_path)]
    written = run_bounded(one_process, 300, cwd=WORKERS, drop_launcher_env=True)
    assert (tmp_path / "lightning_sharded" / "meta.pt").is_file(), written.output[-3000:]
    job = run_job("dcp_interop.py", np=4, hosts=TWO_NODES, out_dir=tmp_path, timeout=300).check()
    assert sorted(job.results) == [0, 1, 2, 3]
    for rank, report in job.results.items():
        for shard in SHARD_MODES:
            found = report[shard]
            assert found["weights"] == EXACT and found["moments"] == EXACT, (rank, shard, found)
            assert found["steps"] == [2.0], (rank, shard, found)  # AdamW's step counts came along
            assert found["moved"] > 1e-4, (rank, shard, found)  # the step from the loaded state trained
            assert found["from_unsharded"] <= TOLERANCE, (rank, shard, found)
        trainer = report["trainer"]  # ckpt_path= under ZeRO-3: validate, then fit one step from its state
        assert trainer["weights"] == EXACT and trainer["seen"] == EXACT, (rank, trainer)
        assert trainer["from_fabric_step"] <= TOLERANCE and trainer["global_step"] == 1, (rank, trainer)
        assert trainer["val_loss"] == job.results[0]["trainer"]["val_loss"], (rank, trainer)
        resumed = report["lightning"]  # Lightning's sharded layout: the fit goes on from its step 2
        assert resumed["global_step"] == 3 and resumed["from_one_process"] <= TOLERANCE, (rank, resumed)
        assert resumed["summary_total"] == resumed["whole"], (rank, resumed)  # the model, not this worker's shard
        assert "not a checkpoint" in report["refused"] and ".metadata" in report["refused"], report["refused"]
