"""Shared by the fault workers: deterministic data, a small model without dropout, a Trainer factory."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_FEATURES = 6


def dataset(n: int = 256) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, N_FEATURES, generator=generator)
    y = (x @ torch.linspace(-1.0, 1.0, N_FEATURES)).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def loader(n: int = 256, batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size, shuffle=True)


class Net(pl.LightningModule):
    """Two linear layers; ``on_step(module, batch_idx)`` lets a worker inject a fault inside training_step."""

    def __init__(
        self,
        hidden: int = 8,
        optimizers: int = 1,
        on_step: Callable[[Net, int], torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.first = nn.Linear(N_FEATURES, hidden)
        self.second = nn.Linear(hidden, 1)
        self.optimizer_count = optimizers
        self.on_step = on_step
        self.automatic_optimization = optimizers == 1
        self.epoch_losses: dict[int, float] = {}  # epoch -> mean training loss over all ranks
        self._losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.on_step is not None:
            factor = self.on_step(self, batch_idx)
            if factor is not None:
                loss = loss * factor
        self._losses.append(loss.detach())
        if not self.automatic_optimization:
            for optimizer in self.optimizers():
                optimizer.zero_grad()
            self.manual_backward(loss)
            for optimizer in self.optimizers():
                optimizer.step()
        return loss

    def on_train_epoch_end(self) -> None:
        mean = torch.stack(self._losses).mean()
        self._losses.clear()
        self.epoch_losses[self.current_epoch] = float(self.trainer.strategy.reduce(mean, reduce_op="mean"))

    def configure_optimizers(self) -> Any:
        if self.optimizer_count == 1:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [torch.optim.SGD(self.first.parameters(), lr=0.05), torch.optim.SGD(self.second.parameters(), lr=0.05)]


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
