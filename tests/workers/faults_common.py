"""Shared by the fault workers: a Trainer factory, weight digests, pid files (the model and data: models.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import nn


def trainer(strategy: Any, epochs: int = 1, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": epochs,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def digest(module: nn.Module) -> str:
    hasher = hashlib.sha256()
    for tensor in module.state_dict().values():
        hasher.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def record_pid(out: Path, rank: int) -> None:
    """Let the test check afterwards that no worker outlived the job."""
    (out / f"pid{rank}").write_text(str(os.getpid()))
