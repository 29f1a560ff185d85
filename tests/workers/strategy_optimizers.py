"""Several optimizers, schedules and frozen layers under HorovodStrategy: manual optimization (a GAN),
accumulation schedules, layers unfrozen between epochs, learning-rate schedules."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from _common import Checks
from finetuning import UnfreezeExtra
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, LearningRateMonitor
from lightning.pytorch.loggers import Logger
from models import Gan, Regression, TwoHeads, TwoSchedules, regression_data
from strategy_common import EpochCalls, all_equal, digest, trainer
from torch.utils.data import DataLoader, TensorDataset

checks = Checks()


def fit_gan(toggle: bool) -> tuple[Gan, pl.Trainer]:
    x, _ = regression_data(64)
    model = Gan(toggle)
    t = trainer(max_epochs=2)
    t.fit(model, DataLoader(TensorDataset(x), batch_size=8))
    return model, t


@checks.register
def check_manual_gan() -> dict[str, Any]:
    """GAN-style manual optimization with toggle_optimizer, as Lightning recommends."""
    model, t = fit_gan(toggle=True)
    counters = t.strategy.comm_counters
    return {
        "ranks_identical": all_equal(digest(model)),
        "steps": t.global_step,
        "allreduce_calls": counters.node_local_calls + counters.cross_node_calls,
        "parameter_tensors": len(list(model.parameters())),
    }


@checks.register
def check_manual_gan_ddp_style() -> dict[str, Any]:
    """The same GAN written the DDP way (no toggle_optimizer) trains to the same parameters."""
    toggled, _ = fit_gan(toggle=True)
    plain, t = fit_gan(toggle=False)
    difference = max(float((a - b).abs().max()) for a, b in zip(toggled.parameters(), plain.parameters(), strict=True))
    return {"ranks_identical": all_equal(digest(plain)), "steps": t.global_step, "max_diff_vs_toggled": difference}


@checks.register
def check_accumulation_schedule() -> dict[str, Any]:
    """An accumulation schedule that changes between epochs is followed: allreduces per epoch."""
    counter = EpochCalls()
    x, y = regression_data(64)
    t = trainer(max_epochs=3, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2, 2: 4}), counter])
    model = Regression()
    t.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    return {
        "calls_per_epoch": counter.per_epoch,
        "batches": t.num_training_batches,
        "ranks_identical": all_equal(digest(model)),
    }


@checks.register
def check_unfrozen_layers_are_averaged() -> dict[str, Any]:
    """A layer unfrozen between epochs (BaseFinetuning) is averaged like the rest, both ways of unfreezing.

    Each rank trains on its own batches, so a layer whose gradients were not averaged would differ
    between ranks. Counts the allreduces per epoch: 2 tensors a step before the unfreezing, 4 after.
    """
    cases = {}
    for name, model, new_group, accumulate in (
        ("new_param_group", TwoHeads(extra_in_optimizer=False), True, 1),
        ("in_place_with_accumulation", TwoHeads(extra_in_optimizer=True), False, 2),
    ):
        counter = EpochCalls()
        x, y = regression_data(64)
        before = model.extra.weight.detach().clone()
        t = trainer(max_epochs=3, accumulate_grad_batches=accumulate, callbacks=[UnfreezeExtra(new_group), counter])
        t.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
        cases[name] = {
            "ranks_identical": all_equal(digest(model)),
            "extra_trained": not torch.equal(before, model.extra.weight.detach()),
            "calls_per_epoch": counter.per_epoch,
            "steps_per_epoch": t.num_training_batches // accumulate,
        }
    return cases


class MemoryLogger(Logger):
    """Keeps what it is given on every rank (Lightning's own loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append(dict(metrics))


@checks.register
def check_learning_rate_schedules() -> dict[str, Any]:
    """Two optimizers of one class with their own schedules: LearningRateMonitor tells them apart, and
    the schedulers, pointed at the wrapped optimizers, raise no warning that their step was replaced."""
    logger = MemoryLogger()
    x, y = regression_data(32)
    monitor = LearningRateMonitor(logging_interval="step")
    t = trainer(max_epochs=1, logger=logger, log_every_n_steps=1, callbacks=[monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(TwoSchedules(), DataLoader(TensorDataset(x, y), batch_size=4))
    rates = [{k: v for k, v in row.items() if k.startswith("lr-")} for row in logger.logged]
    rates = [row for row in rates if row]
    return {
        "first": rates[0] if rates else None,
        "last": rates[-1] if rates else None,
        "rows": len(rates),
        "scheduler_warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
        "optimizer_types_shared": type(t.optimizers[0]) is type(t.optimizers[1]),
    }


@checks.register
def check_accumulation_change_mid_epoch() -> dict[str, Any]:
    """A schedule that changes accumulation inside an epoch cannot be expressed: clear error."""

    class ChangeAtBatchThree(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
            if i == 3:
                trainer.accumulate_grad_batches = 3

    x, y = regression_data(64)
    try:
        trainer(max_epochs=1, callbacks=[ChangeAtBatchThree()]).fit(
            Regression(), DataLoader(TensorDataset(x, y), batch_size=4)
        )
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}
