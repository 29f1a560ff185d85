"""The update each optimizer step makes under HorovodStrategy, against one process on the global batch:
accumulation, clipping, the reduction op, learning-rate scaling."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks
from lightning.pytorch.callbacks import Callback
from models import REGRESSION_FEATURES, ManualAccumulation, Regression, ScheduledRegression, regression_data
from strategy_common import FirstGradients, all_equal, digest, max_difference, rank_loader, reference_sgd, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy

checks = Checks()


@checks.register
def check_accumulation() -> dict[str, Any]:
    """accumulate_grad_batches=k: one allreduce per k micro-batches, same update as a k*W batch."""
    world, micro, k, epochs = hvd.size(), 4, 2, 2
    x, y = regression_data(64)
    model = Regression()
    t = trainer(max_epochs=epochs, accumulate_grad_batches=k, use_distributed_sampler=False)
    t.fit(model, rank_loader(x, y, micro))
    steps = t.global_step
    counters = t.strategy.comm_counters
    reference = reference_sgd(x, y, block=world * micro * k, epochs=epochs, lr=0.05, clip=None)
    return {
        "steps": steps,
        "allreduce_calls": counters.node_local_calls + counters.cross_node_calls,
        "parameter_tensors": len(list(model.parameters())),
        "max_diff_vs_large_batch": max_difference(model, reference),
        "ranks_identical": all_equal(digest(model)),
    }


WIDE = 32768
"""Hidden width of ``WideRegression``: its first weight (5 x 32768 float64, 1.25 MiB) is a bucket of its own."""


class WideRegression(Regression):
    """A hidden layer whose weight is large enough to be summed where it lies (``VIEW_ALONE_BYTES``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.layer = nn.Sequential(nn.Linear(REGRESSION_FEATURES, WIDE), nn.Tanh(), nn.Linear(WIDE, 1))
        self.lr = 1e-4  # the 32768 hidden units add up: a larger step diverges


def reference_wide(x: torch.Tensor, y: torch.Tensor, block: int, epochs: int) -> nn.Module:
    """``WideRegression`` trained by one process on one large batch per step."""
    model = WideRegression().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=model.lr)
    for _ in range(epochs):
        for start in range(0, len(x), block):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[start : start + block]), y[start : start + block]).backward()
            optimizer.step()
    return model


@checks.register
def check_large_gradients_summed_in_place() -> dict[str, Any]:
    """A gradient of a MiB or more goes alone and is summed in place, the rest in a bucket of copies: with
    accumulation, the update of one process on the k*W batch, and two sums a step."""
    world, micro, k, epochs = hvd.size(), 4, 2, 2
    x, y = regression_data(32)
    model = WideRegression()
    t = trainer(max_epochs=epochs, accumulate_grad_batches=k, use_distributed_sampler=False)
    t.fit(model, rank_loader(x, y, micro))
    counters = t.strategy.comm_counters
    return {
        "steps": t.global_step,
        "allreduce_calls": counters.node_local_calls + counters.cross_node_calls,
        "max_diff_vs_large_batch": max_difference(model, reference_wide(x, y, world * micro * k, epochs)),
        "ranks_identical": all_equal(digest(model)),
    }


@checks.register
def check_manual_accumulation() -> dict[str, Any]:
    """Several ``manual_backward`` calls before a step: the update of one process on the k*W batch, op average
    and sum (Horovod's hooks refuse a second backward; the strategy settles the first one's allreduces)."""
    world, micro, k, epochs = hvd.size(), 4, 2, 2
    x, y = regression_data(64)
    cases = {}
    for op, lr in (("average", 0.05), ("sum", 0.05 / world)):
        model = ManualAccumulation(k)
        model.lr = lr
        t = trainer(max_epochs=epochs, strategy=HorovodStrategy(op=op), use_distributed_sampler=False)
        t.fit(model, rank_loader(x, y, micro))
        reference = reference_sgd(x, y, block=world * micro * k, epochs=epochs, lr=0.05, clip=None)
        cases[op] = {
            "steps": t.global_step,
            "max_diff_vs_large_batch": max_difference(model, reference),
            "ranks_identical": all_equal(digest(model)),
        }
    return cases


@checks.register
def check_clipping() -> dict[str, Any]:
    """Clipping by norm must see the averaged gradient, not each rank's own."""
    world, batch = hvd.size(), 8
    x, y = regression_data(64, seed=3)
    model = Regression()
    t = trainer(max_epochs=1, gradient_clip_val=0.5, gradient_clip_algorithm="norm", use_distributed_sampler=False)
    t.fit(model, rank_loader(x, y, batch))
    reference = reference_sgd(x, y, block=world * batch, epochs=1, lr=0.05, clip=0.5)
    unclipped = reference_sgd(x, y, block=world * batch, epochs=1, lr=0.05, clip=None)
    return {
        "max_diff_vs_clipped_reference": max_difference(model, reference),
        "clipping_mattered": max_difference(reference, unclipped),
        "ranks_identical": all_equal(digest(model)),
    }


@checks.register
def check_reduce_ops() -> dict[str, Any]:
    """op='sum' and gradient_predivide_factor against one process on the global batch (float64)."""
    world, batch, epochs, lr = hvd.size(), 8, 2, 0.05
    x, y = regression_data(64, seed=4)
    torch.manual_seed(1)
    probe = nn.Linear(REGRESSION_FEATURES, 1).double()  # Regression's initial weights
    nn.functional.mse_loss(probe(x[: world * batch]), y[: world * batch]).backward()
    mean_gradient = torch.cat([p.grad.reshape(-1) for p in probe.parameters()])  # over the first global batch
    average_reference = reference_sgd(x, y, block=world * batch, epochs=epochs, lr=lr, clip=None)
    # Sum of the ranks' mean gradients = world x the global batch's mean gradient: SGD steps world x larger.
    sum_reference = reference_sgd(x, y, block=world * batch, epochs=epochs, lr=lr * world, clip=None)
    result: dict[str, Any] = {"world": world}
    for label, strategy, scale, reference in (
        ("predivide", HorovodStrategy(op="average", gradient_predivide_factor=2.0), 1.0, average_reference),
        ("sum", HorovodStrategy(op="sum"), float(world), sum_reference),
    ):
        model, spy = Regression(lr=lr), FirstGradients()
        t = trainer(max_epochs=epochs, strategy=strategy, use_distributed_sampler=False, callbacks=[spy])
        t.fit(model, rank_loader(x, y, batch))
        assert spy.gradients is not None
        result[label] = {
            "first_gradient_diff": float((spy.gradients - scale * mean_gradient).abs().max()),
            "max_diff_vs_reference": max_difference(model, reference),
            "max_diff_vs_average_reference": max_difference(model, average_reference),
            "steps": t.global_step,
            "ranks_identical": all_equal(digest(model)),
        }
    return result


@checks.register
def check_scale_lr() -> dict[str, Any]:
    x, y = regression_data(16)
    seen: dict[str, Any] = {}

    class Spy(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
            seen["base_lrs"] = trainer.lr_scheduler_configs[0].scheduler.base_lrs

    t = trainer(max_epochs=1, strategy=HorovodStrategy(scale_lr=True), callbacks=[Spy()])
    t.fit(ScheduledRegression(), DataLoader(TensorDataset(x, y), batch_size=4))
    unscaled: dict[str, Any] = {}

    class SpyDefault(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            unscaled["lr"] = trainer.optimizers[0].param_groups[0]["lr"]

    trainer(max_epochs=1, callbacks=[SpyDefault()]).fit(
        ScheduledRegression(), DataLoader(TensorDataset(x, y), batch_size=4)
    )
    return {"lr": seen["lr"], "base_lrs": seen["base_lrs"], "default_lr": unscaled["lr"], "world": hvd.size()}
