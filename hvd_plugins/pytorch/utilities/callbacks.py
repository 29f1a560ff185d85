"""What the callbacks HorovodStrategy installs share: replacing an earlier fit's, and knowing a batch stepped."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


def trainer_callbacks(trainer: Trainer) -> list[Callback]:
    """``trainer.callbacks``, the list itself (a connector sets it in ``Trainer.__init__``, unseen by type checkers)."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    return callbacks


def replace_callback(trainer: Trainer, kind: type[Callback], callback: Callback | None) -> None:
    """Put ``callback`` (None: nothing) in ``trainer.callbacks`` in place of every ``kind`` an earlier fit added."""
    # A new list, never the old one changed: Lightning may be iterating over it (a callback's hook installs).
    kept = [existing for existing in trainer_callbacks(trainer) if not isinstance(existing, kind)]
    trainer.callbacks = kept + ([callback] if callback is not None else [])  # type: ignore[attr-defined]


class StepAwareCallback(Callback):
    """Knows, at a batch's end, whether that batch stepped the optimizer (not a micro-batch of an accumulation)."""

    _step_at_batch_start = 0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    def stepped(self, trainer: Trainer) -> bool:
        return trainer.global_step > self._step_at_batch_start
