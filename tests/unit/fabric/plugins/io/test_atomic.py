"""AtomicCheckpointIO: a failed save leaves the old file, and files get the mode a plain save gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hvd_plugins import AtomicCheckpointIO


def test_atomic_checkpoint_leaves_old_file_when_saving_fails(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, target)

    class Unpicklable:
        def __reduce__(self) -> tuple:
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        io.save_checkpoint({"step": 2, "bad": Unpicklable()}, target)
    assert torch.load(target, weights_only=False) == {"step": 1}
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the temporary file was removed


def test_atomic_checkpoint_gets_the_mode_a_plain_save_gets(tmp_path: Path) -> None:
    """0666 less the umask, as ``torch.save`` to a path gives, not the 0600 of a private temporary file."""
    previous = os.umask(0o022)
    try:
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "atomic.ckpt")
        torch.save({"step": 1}, tmp_path / "plain.ckpt")
        os.umask(0o007)
        AtomicCheckpointIO().save_checkpoint({"step": 2}, tmp_path / "group.ckpt")
    finally:
        os.umask(previous)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("atomic.ckpt", "plain.ckpt", "group.ckpt")}
    assert modes == {"atomic.ckpt": 0o644, "plain.ckpt": 0o644, "group.ckpt": 0o660}
    assert sorted(os.listdir(tmp_path)) == ["atomic.ckpt", "group.ckpt", "plain.ckpt"]
