"""The Trainer's preemption handling: where the next HPC checkpoint goes."""

from __future__ import annotations

from pathlib import Path

from hvd_plugins.pytorch.preemption import next_hpc_checkpoint


def test_hpc_checkpoints_are_numbered_after_the_highest(tmp_path: Path) -> None:
    assert next_hpc_checkpoint(tmp_path).name == "hpc_ckpt_1.ckpt"
    for name in ("hpc_ckpt_1.ckpt", "hpc_ckpt_7.ckpt", "hpc_ckpt_x.ckpt", "last.ckpt"):
        (tmp_path / name).touch()
    assert next_hpc_checkpoint(tmp_path).name == "hpc_ckpt_8.ckpt"
