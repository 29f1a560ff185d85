"""The one owner of the training-loop events HorovodStrategy needs but Lightning gives only to callbacks.

Lightning calls a strategy at batch start, never at batch or epoch end, so the strategy installs
this callback. It turns the loop into three events and drives everything that hangs on them:

- epoch start: follow accumulation schedules, refuse uneven data for the node-aware syncs, tell the
  gradient sync (DASO re-reads which parameters are trainable);
- batch start: refuse an accumulation change inside the epoch; the gradient sync's batch hook;
- batch end: the gradient sync's step hook, when the batch stepped the optimizer (DASO's cross-node step);
- the epoch's last batch: the epoch-end policy joins uneven ranks and averages buffers; the gradient
  sync closes its epoch, with the epoch's training loss averaged over all workers should it ask
  (DASO's schedule picks the next epoch's settings from it). This runs before validation and
  checkpointing, so both see the state the next epoch starts from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from hvd_plugins.core.epoch_end import EpochEndPolicy
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.pytorch.utilities.callbacks import StepAwareCallback, replace_callback


def batch_loss(outputs: Any, trainer: Trainer, pl_module: LightningModule) -> float | None:
    """The loss a training step returned (a tensor, or a dict with ``"loss"``), if any.

    Under automatic optimization Lightning hands callbacks that loss divided by
    ``accumulate_grad_batches`` (what backward sees); this gives back the step's own.
    """
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        value = float(loss.detach())
    elif isinstance(loss, (int, float)):
        value = float(loss)
    else:
        return None
    return value * trainer.accumulate_grad_batches if pl_module.automatic_optimization else value


def is_last_batch(trainer: Trainer, batch_idx: int) -> bool:
    """Whether the batch that just ended is the epoch's last one (data end, limit or max_steps)."""
    return (
        trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        or batch_idx + 1 >= trainer.num_training_batches
        or (trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps)
    )


def training_position(trainer: Trainer | None) -> str:
    """Where training is, for failure messages: "epoch E, global step S" (or "setup")."""
    if trainer is None:
        return "setup"
    return f"epoch {trainer.current_epoch}, global step {trainer.global_step}"


def training_data_name(trainer: Trainer) -> str:
    """The training dataset's type, for error messages ("the training data" when there is none)."""
    dataset = getattr(trainer.train_dataloader, "dataset", None)
    return "the training data" if dataset is None else f"the training dataset ({type(dataset).__name__})"


class TrainingLoopEvents(StepAwareCallback):
    """Drives the epoch-end policy and the gradient sync's hooks from Lightning's loop; installed by HorovodStrategy.

    ``reduce`` is the strategy's (``reduce(tensor, reduce_op="sum")`` over every worker).
    """

    def __init__(self, epoch_end: EpochEndPolicy, gradient_sync: GradientSync, reduce: Callable[..., torch.Tensor]):
        self.epoch_end = epoch_end
        self.gradient_sync = gradient_sync
        self.reduce = reduce
        self._epoch_open = False
        self._loss_sum = 0.0
        self._loss_count = 0

    @classmethod
    def install(
        cls,
        trainer: Trainer,
        epoch_end: EpochEndPolicy,
        gradient_sync: GradientSync,
        reduce: Callable[..., torch.Tensor],
    ) -> None:
        """Add a new owner of the loop events to ``trainer``, replacing the one of an earlier fit."""
        replace_callback(trainer, cls, cls(epoch_end, gradient_sync, reduce))

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_open = True
        self._loss_sum, self._loss_count = 0.0, 0
        self.epoch_end.check_even_batches(trainer.num_training_batches, training_data_name(trainer))
        self._follow_accumulation(trainer)
        self.gradient_sync.on_train_epoch_start()  # after user callbacks that (un)freeze parameters

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.accumulate_grad_batches != self.gradient_sync.backward_passes:
            raise ValueError(
                f"accumulate_grad_batches changed to {trainer.accumulate_grad_batches} in the middle of epoch "
                f"{trainer.current_epoch} (was {self.gradient_sync.backward_passes}). HorovodStrategy follows "
                "accumulation schedules that change at epoch starts (GradientAccumulationScheduler), not within "
                "an epoch."
            )
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.gradient_sync.on_train_batch_start()

    def _follow_accumulation(self, trainer: Trainer) -> None:
        """Accumulation schedules (GradientAccumulationScheduler) change at epoch starts."""
        passes = trainer.accumulate_grad_batches
        if passes != self.gradient_sync.backward_passes:
            for optimizer in trainer.strategy.optimizers:
                self.gradient_sync.set_backward_passes(optimizer, passes)
            self.gradient_sync.backward_passes = passes

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = batch_loss(outputs, trainer, pl_module)
        if loss is not None and math.isfinite(loss):
            self._loss_sum += loss
            self._loss_count += 1
        last = is_last_batch(trainer, batch_idx)
        if self.stepped(trainer):
            self.gradient_sync.after_optimizer_step(last_batch_of_epoch=last)
        if last:
            self._close_epoch(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._epoch_open:  # the loop ended without a batch we recognised as the last
            self._close_epoch(trainer, pl_module)

    def _close_epoch(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_open = False
        model = trainer.strategy.model
        self.epoch_end.finish(model, trainer.strategy.optimizers, trainer.global_step)
        self.gradient_sync.on_train_epoch_end(self._all_rank_mean_loss)

    def _all_rank_mean_loss(self) -> float | None:
        """The epoch's mean training loss over every worker's batches (a collective); None without losses."""
        local = torch.tensor([self._loss_sum, float(self._loss_count)], dtype=torch.float64)
        totals = self.reduce(local, reduce_op="sum")
        return float(totals[0] / totals[1]) if totals[1] > 0 else None
