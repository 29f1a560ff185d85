"""Helpers the callbacks share: gather one row of numbers per worker, print and log on rank 0."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch import Trainer

from hvd_plugins.core import tables


def gather_rows(trainer: Trainer, values: Sequence[float]) -> list[list[float]]:
    """Every worker's ``values`` (same length on all workers), in rank order; a collective.

    Uses the strategy's ``all_gather``, so it works with any Lightning strategy; a single-device
    strategy returns the tensor without the worker dimension, which is added here.
    """
    row = torch.tensor(list(values), dtype=torch.float64, device=trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(row)
    if gathered.dim() == row.dim():
        gathered = gathered.unsqueeze(0)
    return gathered.cpu().tolist()


def log_to_loggers(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger of the Trainer with the current step and epoch (rank 0 only)."""
    if not trainer.is_global_zero or not trainer.loggers or not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics({**metrics, "epoch": float(trainer.current_epoch)}, step=trainer.global_step)


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The repository's table layout with two decimals: the callbacks' columns (MiB, seconds) read side by side."""
    return tables.format_table(header, rows, decimals=2)
