"""Logs where DASO's schedule stands after every training epoch."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from hvd_plugins.core.sync.daso.schedule import EpochRecord


class DasoScheduleCallback(Callback):
    """Logs the settings each epoch ran with and the loss the schedule judged it by.

    Per epoch: ``daso/phase`` (0 warmup, 1 cycling, 2 cooldown), ``daso/global_skips``,
    ``daso/batches_to_wait`` and ``daso/epoch_loss`` (the training loss averaged over the epoch and
    over all workers; with accumulation Lightning reports it divided by the number of accumulated
    batches, which the schedule's relative comparison does not mind). It only reads
    ``trainer.strategy.daso_sync.schedule.history``: the strategy drives DASO with or without
    this callback. With another strategy or sync mode it warns once and logs nothing.
    """

    def __init__(self) -> None:
        self._warned = False

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = self._last_record(trainer)
        if record is None:
            return
        metrics = {
            "daso/phase": float(record.phase.code),
            "daso/global_skips": float(record.global_skips),
            "daso/batches_to_wait": float(record.batches_to_wait),
        }
        if record.loss is not None:
            metrics["daso/epoch_loss"] = record.loss
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=False)  # equal on all ranks

    def _last_record(self, trainer: Trainer) -> EpochRecord | None:
        daso_sync = getattr(trainer.strategy, "daso_sync", None)
        if daso_sync is None:
            if not self._warned:
                rank_zero_warn("DasoScheduleCallback does nothing: the strategy is not HorovodStrategy(sync='daso')")
                self._warned = True
            return None
        history = daso_sync.schedule.history
        return history[-1] if history else None
