"""BatchNorm under HorovodStrategy: synchronized statistics, buffers averaged at every epoch end, and
SyncBatchNorm while ranks hold different numbers of batches."""

from __future__ import annotations

import copy
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks
from lightning.pytorch.callbacks import Callback
from models import BatchNormRegression, HiddenBatchNormRegression, regression_data
from strategy_common import all_equal, digest, floating_buffers, max_difference, rank_loader, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy, HorovodSyncBatchNorm

checks = Checks()
last = Checks()
"""Run after every other check of the job, bounded: a hang there is reported and the rest still counts."""


@checks.register
def check_sync_batchnorm() -> dict[str, Any]:
    """Synchronized BatchNorm on each rank's half == plain BatchNorm on the whole batch."""
    from hvd_plugins.core.sync_batchnorm import convert_sync_batchnorm

    generator = torch.Generator().manual_seed(7)
    full = torch.randn(16, 4, generator=generator, dtype=torch.float64) * 3 + 1
    upstream = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    plain = nn.BatchNorm1d(4).double()
    synced = convert_sync_batchnorm(nn.Sequential(copy.deepcopy(plain)))[0]
    mine = slice(hvd.rank() * 8, (hvd.rank() + 1) * 8)

    x_full = full.clone().requires_grad_()
    expected = plain(x_full)
    (expected * upstream).sum().backward()
    x_mine = full[mine].clone().requires_grad_()
    out = synced(x_mine)
    (out * upstream[mine]).sum().backward()
    # the loss is summed over ranks by data parallelism; the input gradient already includes
    # the other rank's terms through the synchronized statistics.
    norm_types: list[str] = []

    class NormTypeProbe(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            norm_types.append(type(pl_module.norm).__name__)

    t = trainer(max_epochs=1, sync_batchnorm=True, callbacks=[NormTypeProbe()])

    model = BatchNormRegression()
    model.norm.double()
    x, y = regression_data(32)
    t.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return {
        "type": type(synced).__name__,
        "output_diff": float((out - expected[mine]).abs().max()),
        "input_grad_diff": float((x_mine.grad - x_full.grad[mine]).abs().max()),
        "running_mean_diff": float((synced.running_mean - plain.running_mean).abs().max()),
        "trainer_converted": norm_types == ["SyncBatchNorm"],
        "reverted_after_fit": type(model.norm) is nn.BatchNorm1d,
        "trainer_norm_dtypes": sorted(
            {str(t.dtype) for t in model.norm.state_dict().values() if t.is_floating_point()}
        ),
        "ranks_identical": all_equal(digest(model)),
    }


@checks.register
def check_average_buffers() -> dict[str, Any]:
    """average_buffers=True: after each epoch every rank holds the mean of the ranks' own BatchNorm statistics."""
    x, y = regression_data(64, seed=20)
    models = {}
    for average in (True, False):
        model = BatchNormRegression()
        t = trainer(max_epochs=2, strategy=HorovodStrategy(average_buffers=average), use_distributed_sampler=False)
        t.fit(model, rank_loader(x, y, 8))  # each rank normalizes its own half: its own running statistics
        models[average] = model
    averaged, own = floating_buffers(models[True]), floating_buffers(models[False])
    # BatchNorm trains on batch statistics, so both runs take the same steps; the running statistics
    # follow a linear recurrence, so averaging them after every epoch equals averaging the ranks'
    # own final statistics once.
    rows = hvd.allgather(own.unsqueeze(0), name="test.average_buffers.own")
    return {
        "max_diff_vs_mean_of_own": float((averaged - rows.mean(dim=0)).abs().max()),
        "own_spread_across_ranks": float((rows.max(dim=0).values - rows.min(dim=0).values).max()),
        "own_ranks_identical": all_equal(digest(models[False])),
        "averaged_ranks_identical": all_equal(digest(models[True])),
        "parameters_diff_between_runs": max_difference(models[True], models[False]),
        "buffer_elements": averaged.numel(),
    }


@last.register(time_limit=120.0)
def check_uneven_sync_batchnorm() -> dict[str, Any]:
    """SyncBatchNorm while ranks hold different numbers of batches: no hang, identical ranks after."""
    n = 40 if hvd.rank() == 0 else 24
    x, y = regression_data(n, seed=30 + hvd.rank())
    model = HiddenBatchNormRegression()
    loader = DataLoader(TensorDataset(x.float(), y.float()), batch_size=4)
    norm_types: list[str] = []

    class NormTypeProbe(Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            norm_types.append(type(pl_module.norm).__name__)

    t = trainer(
        max_epochs=2,
        plugins=[HorovodSyncBatchNorm()],
        callbacks=[NormTypeProbe()],
        use_distributed_sampler=False,
        limit_val_batches=2,
        precision="32-true",  # float32: the float64 dtype of converted layers is checked in "sync_batchnorm"
    )
    t.fit(model, loader, loader)
    return {
        "batches": t.num_training_batches,
        "steps": t.global_step,
        "norm_type": norm_types[-1] if norm_types else None,
        "ranks_identical": all_equal(digest(model)),
    }
