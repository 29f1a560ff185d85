"""The fine-tuning callback the unfreezing checks share (strategy_features.py, adasum_checks.py, daso_checks.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning


class UnfreezeExtra(BaseFinetuning):
    """Lightning's fine-tuning callback: ``extra`` frozen before training, unfrozen at epoch ``epoch``,
    either as a new param group (``unfreeze_and_add_param_group``) or in place (already in the optimizer)."""

    def __init__(self, new_group: bool, epoch: int = 1) -> None:
        super().__init__()
        self.new_group = new_group
        self.epoch = epoch

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.extra)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.epoch and self.new_group:
            self.unfreeze_and_add_param_group(pl_module.extra, optimizer)
        elif epoch == self.epoch:
            self.make_trainable(pl_module.extra)
