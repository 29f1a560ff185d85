"""Feeds DASO's schedule the epoch's training loss and logs where the schedule stands."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from hvd_plugins.daso.schedule import DasoSchedule


def _batch_loss(outputs: Any) -> float | None:
    """The loss a training step returned (a tensor, or a dict with ``"loss"``), if any."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach())
    if isinstance(loss, (int, float)):
        return float(loss)
    return None


class DasoScheduleCallback(Callback):
    """Averages the training loss over the epoch and over ALL workers and hands it to DASO.

    The strategy adds this callback by itself with ``sync="daso"``; with any other strategy it
    does nothing. Per epoch it logs ``daso/phase`` (0 warmup, 1 cycling, 2 cooldown),
    ``daso/global_skips``, ``daso/batches_to_wait`` (the settings the epoch ran with) and
    ``daso/epoch_loss``. With accumulation, Lightning reports the loss divided by the number
    of accumulated batches; the schedule only compares losses relatively, so that is harmless.
    """

    def __init__(self) -> None:
        self._loss_sum = 0.0
        self._loss_count = 0
        self._pending_state: dict[str, Any] | None = None
        self._strategy: Any = None

    @staticmethod
    def _schedule(trainer: Trainer) -> DasoSchedule | None:
        daso = getattr(trainer.strategy, "daso", None)
        return None if daso is None else daso.schedule

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._strategy = trainer.strategy
        schedule = self._schedule(trainer)
        if schedule is not None and self._pending_state is not None:
            schedule.load_state_dict(self._pending_state)
        self._pending_state = None

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loss_sum, self._loss_count = 0.0, 0

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._schedule(trainer) is None:
            return
        loss = _batch_loss(outputs)
        if loss is not None and math.isfinite(loss):
            self._loss_sum += loss
            self._loss_count += 1

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        schedule = self._schedule(trainer)
        if schedule is None:
            return
        # Every worker takes part, so every worker's schedule sees the same loss.
        totals = torch.tensor([self._loss_sum, float(self._loss_count)], dtype=torch.float64)
        totals = trainer.strategy.reduce(totals, reduce_op="sum")
        loss_sum, count = float(totals[0]), float(totals[1])
        epoch_loss = loss_sum / count if count > 0 else None
        metrics = {
            "daso/phase": float(schedule.phase.code),
            "daso/global_skips": float(schedule.global_skips),
            "daso/batches_to_wait": float(schedule.batches_to_wait),
        }
        if epoch_loss is not None:
            metrics["daso/epoch_loss"] = epoch_loss
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=False)
        trainer.strategy.daso.on_train_epoch_end(epoch_loss)

    @override
    def state_dict(self) -> dict[str, Any]:
        daso = getattr(self._strategy, "daso", None)
        return {} if daso is None else {"schedule": daso.schedule.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Callbacks are restored before the strategy builds DASO; the state is applied when training
        # starts. Only a callback passed to the Trainer is restored: pass DasoScheduleCallback()
        # yourself to resume the schedule from a checkpoint.
        self._pending_state = state_dict.get("schedule")
