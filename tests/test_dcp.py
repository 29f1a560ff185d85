"""Checkpoints in torch's own format (DCP) written by FSDP2, loaded by ``fabric.load`` under HorovodStrategy.

Two processes under ``torch.distributed.run`` train a small GPT with ``fully_shard`` and save it with
``dcp.save`` (tests/workers/dcp_interop.py); four Horovod workers on two emulated nodes then load the directory
into a model and AdamW set up unsharded, with ZeRO-1 and with ZeRO-3, and take a step from it; the Trainer reads
it through ``ckpt_path=`` under ZeRO-3 for ``validate`` and ``fit``. A one-process Trainer's checkpoint laid out
as Lightning's ``FSDPStrategy(state_dict_type="sharded")`` writes it (Lightning's FSDP needs a GPU) resumes under
ZeRO-3 where it stopped, equal to the one process resuming from its own file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from hvd_launch import TWO_NODES, WORKERS, run_job

from hvd_plugins.testing.launch import run_bounded

COVERS = (
    "hvd_plugins.core.checkpoint.boxes",
    "hvd_plugins.core.checkpoint.dcp_read",
    "hvd_plugins.core.checkpoint.dcp_source",
    "hvd_plugins.core.checkpoint.dcp_write",
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


def test_a_sharded_checkpoint_is_written_by_every_worker_and_read_at_two_workers_by_fsdp2_and_by_one_process(
    tmp_path: Path,
) -> None:
    saved = run_job("dcp_roundtrip.py", "--save", np=4, hosts=TWO_NODES, out_dir=tmp_path, timeout=300).check()
    for rank, report in saved.results.items():
        assert report["parameters"] > 0, (rank, report)  # every worker wrote shards of its own (ZeRO-3)
        assert report["trainer"] == [f"epoch={e}-step={s}.ckpt" for e, s in ((0, 1), (0, 2), (1, 3))], report
    assert not list(tmp_path.glob(".fabric_*")), sorted(p.name for p in tmp_path.iterdir())  # nothing left aside
    for written in tmp_path.glob("rank*.json"):
        written.unlink()  # the 2-worker job reports in the same folder
    loaded = run_job("dcp_roundtrip.py", np=2, out_dir=tmp_path, timeout=300).check()
    for rank, report in loaded.results.items():
        for case in ("none->parameters", "optimizer->parameters", "parameters->parameters", "parameters->none"):
            found = report[case]
            assert found["weights"] == EXACT and found["moments"] == EXACT, (rank, case, found)
            assert found["steps"] == [2.0] and found["left"] == {"step": 2}, (rank, case, found)
        assert "size mismatch for model." in report["other_model"], report["other_model"]  # named, on every worker
        resumed = report["trainer"]  # 4 workers' step-2 directory, resumed at 2 workers
        assert resumed["global_step"] == 3 and resumed["from_four_workers"] <= TOLERANCE, (rank, resumed)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(WORKERS / "dcp_roundtrip.py"), "--fsdp2", "--out", str(tmp_path)]
    fsdp2 = run_bounded(command, 300, out_dir=tmp_path, cwd=WORKERS)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"fsdp2_rank{rank}.json").read_text())
        assert found["weights"] == EXACT and found["moments"] == EXACT, (rank, found, fsdp2.output[-2000:])
        assert found["steps"] == [2.0], (rank, found)
    one_process_reads(tmp_path)


def one_process_reads(out: Path) -> None:
    """torch's ``dcp_to_torch_save`` and Lightning's ``consolidate_checkpoint`` make the directories one file."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reference = torch.load(out / "reference_parameters.pt", weights_only=False)
    dcp_to_torch_save(out / "fabric_parameters", out / "whole.pt")
    whole = torch.load(out / "whole.pt", weights_only=False)
    assert all(torch.equal(whole["model"][k], v) for k, v in reference["model"].items())
    consolidated = _load_distributed_checkpoint(out / "trainer" / "epoch=0-step=2.ckpt")
    assert consolidated["global_step"] == 2 and set(consolidated["model"]) == set(reference["model"])


def test_a_worker_killed_while_a_background_save_writes_leaves_the_last_complete_checkpoint(tmp_path: Path) -> None:
    killed = run_job("dcp_roundtrip.py", "--killed", np=4, hosts=TWO_NODES, out_dir=tmp_path, timeout=300)
    assert killed.returncode != 0 and not killed.results, killed.output[-2000:]  # the job ended, none finished
    assert list(tmp_path.glob(".killed.writing-*")), sorted(p.name for p in tmp_path.iterdir())  # left aside
    resumed = run_job("dcp_roundtrip.py", "--resume-killed", np=2, out_dir=tmp_path, timeout=300).check()
    for rank, found in resumed.results.items():
        assert found["left"] == {"step": 1} and found["weights"] == EXACT, (rank, found)
