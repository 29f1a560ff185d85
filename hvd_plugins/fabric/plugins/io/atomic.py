"""Checkpoints written atomically: a crash mid-save never leaves a truncated file behind."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from hvd_plugins.fabric.lightning_internals import CheckpointPath


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the target folder, flush it to disk, then rename.

    ``os.replace`` is atomic on POSIX file systems, so a reader (or a resumed run) sees either
    the previous complete checkpoint or the new complete one.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: CheckpointPath, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO.save_checkpoint got storage_options={storage_options!r}; it takes none"
            )
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = _create_temporary(target.parent)
        try:
            with os.fdopen(handle, "wb") as stream:
                torch.save(checkpoint, stream)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def _create_temporary(folder: Path) -> tuple[int, Path]:
    """A new file in ``folder`` for writing, with the mode a plain ``open`` gives (0666 less the umask).

    ``tempfile.mkstemp`` would make it 0600, and the rename would carry that to the checkpoint, so
    the rest of a group sharing the folder could not read it. Not named after the target:
    Lightning finds ``hpc_ckpt_<n>`` versions by the digits after that prefix, so a temporary file
    left by a killed save must not carry it.
    """
    while True:
        temporary = folder / f".partial-checkpoint-{secrets.token_hex(8)}.tmp"
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temporary
        except FileExistsError:
            continue
