"""Training-loop events the strategy needs but Lightning only gives to callbacks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

if TYPE_CHECKING:
    from hvd_plugins.strategy import HorovodStrategy


class StrategyLoopHooks(Callback):
    """Forwards batch and epoch ends to the strategy; added by the strategy itself."""

    def __init__(self, strategy: HorovodStrategy) -> None:
        self.strategy = strategy

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.on_train_epoch_start_hook(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.strategy.on_train_batch_end_hook(trainer, batch_idx)
