"""What the strategy checks share: a Trainer factory, single-process references, digests, probes."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from models import REGRESSION_FEATURES
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy


def digest(module: nn.Module) -> str:
    """A fingerprint of the parameters, to compare ranks exactly."""
    hasher = hashlib.sha256()
    for tensor in module.state_dict().values():
        hasher.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def all_equal(value: Any) -> bool:
    return all(other == value for other in hvd.allgather_object(value))


def trainer(**kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        strategy=HorovodStrategy(),
        accelerator="cpu",
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def floating_buffers(module: nn.Module) -> torch.Tensor:
    return torch.cat([b.detach().reshape(-1).double() for b in module.buffers() if b.is_floating_point()])


def rank_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> DataLoader:
    """This rank's strided share, unshuffled (Lightning's own sampler shuffles training data)."""
    share = range(hvd.rank(), len(x), hvd.size())
    return DataLoader(Subset(TensorDataset(x, y), list(share)), batch_size=batch_size)


def reference_sgd(
    x: torch.Tensor, y: torch.Tensor, block: int, epochs: int, lr: float, clip: float | None
) -> nn.Module:
    """One process, one large batch per step: the update data parallelism must reproduce."""
    torch.manual_seed(1)
    model = nn.Linear(REGRESSION_FEATURES, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(x), block):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[start : start + block]), y[start : start + block]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
    return model


def max_difference(model: nn.Module, reference: nn.Module) -> float:
    return max(
        float((a.detach().cpu() - b.detach().cpu()).abs().max())
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


class EpochCalls(Callback):
    """Collectives handed to Horovod per training epoch (the comm counters)."""

    def __init__(self) -> None:
        self.per_epoch: list[float] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = copy.copy(trainer.strategy.comm_counters)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = trainer.strategy.comm_counters.since(self.start)
        self.per_epoch.append(window.cross_node_calls + window.node_local_calls)


class FirstGradients(Callback):
    """The gradients the optimizer sees at its first step (after the strategy's allreduce)."""

    def __init__(self) -> None:
        self.gradients: torch.Tensor | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.gradients is None:
            self.gradients = torch.cat([p.grad.detach().reshape(-1).clone() for p in pl_module.parameters()])
