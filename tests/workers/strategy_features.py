"""Lightning features under HorovodStrategy, checked against single-process references.

The one job of two workers on one node that the checks of tests/test_strategy_multiprocess.py and
tests/test_faults.py share (``faults_checks.CHECKS`` run here too), under ``horovodrun -np 2``.
Every rank runs every check in the same order and writes its report to ``--out/rank<r>.json``.
With ``--adasum`` (under the MPI controller) Adasum's checks (adasum_checks.py) run in it too.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import parse_out, run_checks, write_result
from adasum_checks import adasum_report
from faults_checks import CHECKS as FAULT_CHECKS
from finetuning import UnfreezeExtra
from lightning.pytorch.callbacks import (
    Callback,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.loggers import Logger
from models import (
    REGRESSION_FEATURES,
    BatchNormRegression,
    Gan,
    HiddenBatchNormRegression,
    ManualAccumulation,
    MetricClassifier,
    Regression,
    ScheduledRegression,
    TwoHeads,
    TwoSchedules,
    regression_data,
)
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from hvd_plugins.pytorch import AtomicCheckpointIO, HorovodStrategy, HorovodSyncBatchNorm

OUT, ARGS = parse_out()


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


def flat_parameters(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


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


# ----------------------------------------------------------------------------------------------
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


def check_float16_sum() -> dict[str, Any]:
    """Horovod's float16 allreduce (Gloo's F16C sum in the wheel hvd-build-horovod builds) against
    float32 addition rounded once: sizes that are and are not multiples of the 8-wide vector loop."""
    exact = {}
    for numel in (1, 7, 8, 9, 1003, 100_001):
        pieces = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).half() for r in range(hvd.size())]
        got = hvd.allreduce(pieces[hvd.rank()], op=hvd.Sum, name=f"check.fp16.{numel}")
        expected = (pieces[0].float() + pieces[1].float()).half()
        exact[numel] = bool(torch.equal(got, expected))
    return {"exact": exact}


def check_waiting_without_spinning() -> dict[str, Any]:
    """A blocking collective that waits for a late rank (Horovod's synchronize, in the wheel
    hvd-build-horovod builds) sleeps instead of spinning: the waiting thread uses little CPU."""
    late_seconds = 1.0
    if hvd.rank() == 0:
        time.sleep(late_seconds)
    started, cpu_started = time.monotonic(), time.thread_time()
    hvd.allreduce(torch.ones(4), name="check.wait_without_spinning")
    return {"waited_seconds": time.monotonic() - started, "thread_cpu_seconds": time.thread_time() - cpu_started}


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


def check_collectives() -> dict[str, Any]:
    t = trainer(max_epochs=1)
    x, y = regression_data(8)
    t.fit(Regression(), DataLoader(TensorDataset(x, y), batch_size=4))
    strategy = t.strategy
    rank = float(hvd.rank())
    value = torch.tensor([rank + 1.0])
    gathered = strategy.all_gather(torch.tensor([rank, rank * 10, 7.0]))
    strategy.barrier("check")
    return {
        "is_distributed": strategy.is_distributed,
        "sum": strategy.reduce(value.clone(), reduce_op="sum").tolist(),
        "mean": strategy.reduce(value.clone(), reduce_op="mean").tolist(),
        "max": strategy.reduce(value.clone(), reduce_op="max").tolist(),
        "int_mean": strategy.reduce(torch.tensor([hvd.rank()]), reduce_op="mean").tolist(),
        "gathered": gathered.tolist(),
        "broadcast": strategy.broadcast({"from": hvd.rank()}, src=1),
        "any_true": strategy.reduce_boolean_decision(hvd.rank() == 1, all=False),
        "all_true": strategy.reduce_boolean_decision(hvd.rank() == 1, all=True),
        "sampler_kwargs": strategy.distributed_sampler_kwargs,
        "torch_threads": torch.get_num_threads(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def check_metrics() -> dict[str, Any]:
    """A torchmetrics metric logged under Horovod equals the metric over the full data."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(80, REGRESSION_FEATURES, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (80,), generator=generator)

    model = MetricClassifier()
    correct = (model.layer.double()(x).argmax(dim=1) == labels).double()
    reference = float(correct.mean())
    local = float(correct[hvd.rank() :: hvd.size()].mean())  # what an unsynced metric would report
    results = trainer().validate(model, DataLoader(TensorDataset(x, labels), batch_size=8), verbose=False)
    return {"logged": results[0]["val_acc"], "full_data": reference, "local": local}


def check_loops() -> dict[str, Any]:
    x, y = regression_data(40)
    loader = DataLoader(TensorDataset(x, y), batch_size=5)
    model = Regression()
    t = trainer(max_epochs=1)
    t.fit(model, loader, loader)
    validated = t.validate(model, loader, verbose=False)[0]["val_loss"]
    tested = t.test(model, loader, verbose=False)[0]["test_loss"]
    predictions = t.predict(model, loader)
    full = float(nn.functional.mse_loss(model(x.to(model.device)), y))
    return {
        "val_loss": validated,
        "test_loss": tested,
        "full_data_loss": full,
        "predicted_rows": sum(len(p) for p in predictions),
        "ranks_identical": all_equal(digest(model)),
    }


def fit_gan(toggle: bool) -> tuple[Gan, pl.Trainer]:
    x, _ = regression_data(64)
    model = Gan(toggle)
    t = trainer(max_epochs=2)
    t.fit(model, DataLoader(TensorDataset(x), batch_size=8))
    return model, t


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


def check_manual_gan_ddp_style() -> dict[str, Any]:
    """The same GAN written the DDP way (no toggle_optimizer) trains to the same parameters."""
    toggled, _ = fit_gan(toggle=True)
    plain, t = fit_gan(toggle=False)
    difference = max(float((a - b).abs().max()) for a, b in zip(toggled.parameters(), plain.parameters(), strict=True))
    return {"ranks_identical": all_equal(digest(plain)), "steps": t.global_step, "max_diff_vs_toggled": difference}


def check_bf16_mixed() -> dict[str, Any]:
    x, y = regression_data(64)
    model = Regression()
    t = trainer(max_epochs=2, precision="bf16-mixed")
    t.fit(model.float(), DataLoader(TensorDataset(x.float(), y.float()), batch_size=8))
    return {
        "ranks_identical": all_equal(digest(model)),
        "loss": float(t.callback_metrics["train_loss"]),
        "first_loss": float(nn.functional.mse_loss(Regression().float()(x.float()), y.float())),
    }


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


class CountingCheckpointIO(AtomicCheckpointIO):
    saves = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        CountingCheckpointIO.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


def check_checkpoint_resume() -> dict[str, Any]:
    """Rank 0 alone writes; resuming gives every rank the checkpoint's weights and optimizer state."""
    directory = Path(hvd.broadcast_object(str(OUT / "checkpoints"), root_rank=0))
    x, y = regression_data(48)
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    t = trainer(
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)],
        plugins=[CountingCheckpointIO()],
    )
    t.fit(Regression(optimizer="adam"), loader)
    saves = CountingCheckpointIO.saves
    hvd.barrier()
    checkpoint = torch.load(directory / "last.ckpt", weights_only=False)
    expected = {k: v.clone() for k, v in checkpoint["state_dict"].items()}
    seen: dict[str, Any] = {}

    class AtStart(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            state = pl_module.state_dict()
            seen["max_diff_vs_checkpoint"] = max(float((state[k].cpu() - v).abs().max()) for k, v in expected.items())
            seen["weights_digest"] = digest(pl_module)
            adam = trainer.optimizers[0].state_dict()["state"]
            seen["adam_steps"] = sorted(float(s["step"]) for s in adam.values())

    # rank 1 starts from different weights: the restore and broadcast must override them
    resumed = Regression(optimizer="adam")
    if hvd.rank() == 1:
        with torch.no_grad():
            resumed.layer.weight.add_(1.0)
    trainer(max_epochs=3, callbacks=[AtStart()]).fit(resumed, loader, ckpt_path=directory / "last.ckpt")
    return {
        "saves": saves,
        "files": sorted(p.name for p in directory.iterdir()),
        "max_diff_vs_checkpoint": seen["max_diff_vs_checkpoint"],
        "weights_identical": all_equal(seen["weights_digest"]),
        "adam_state_identical": all_equal(seen["adam_steps"]),
        "adam_steps": seen["adam_steps"],
        "final_identical": all_equal(digest(resumed)),
    }


def check_uneven_data() -> dict[str, Any]:
    """Ranks with different numbers of batches finish without hanging (Horovod join)."""
    n = 40 if hvd.rank() == 0 else 24
    x, y = regression_data(n, seed=10 + hvd.rank())
    model = Regression()
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    t = trainer(max_epochs=2, use_distributed_sampler=False, limit_val_batches=2)
    t.fit(model, loader, loader)
    return {"batches": t.num_training_batches, "ranks_identical": all_equal(digest(model)), "steps": t.global_step}


class EpochCalls(Callback):
    """Collectives handed to Horovod per training epoch (the comm counters)."""

    def __init__(self) -> None:
        self.per_epoch: list[float] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = copy.copy(trainer.strategy.comm_counters)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = trainer.strategy.comm_counters.since(self.start)
        self.per_epoch.append(window.cross_node_calls + window.node_local_calls)


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


class FirstGradients(Callback):
    """The gradients the optimizer sees at its first step (after the strategy's allreduce)."""

    def __init__(self) -> None:
        self.gradients: torch.Tensor | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.gradients is None:
            self.gradients = torch.cat([p.grad.detach().reshape(-1).clone() for p in pl_module.parameters()])


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


if __name__ == "__main__":
    hvd.init()
    checks = {
        "accumulation": check_accumulation,
        "manual_accumulation": check_manual_accumulation,
        "clipping": check_clipping,
        "scale_lr": check_scale_lr,
        "collectives": check_collectives,
        "metrics": check_metrics,
        "loops": check_loops,
        "manual_gan": check_manual_gan,
        "manual_gan_ddp_style": check_manual_gan_ddp_style,
        "bf16_mixed": check_bf16_mixed,
        "sync_batchnorm": check_sync_batchnorm,
        "checkpoint_resume": check_checkpoint_resume,
        "uneven_data": check_uneven_data,
        "accumulation_schedule": check_accumulation_schedule,
        "unfrozen_layers": check_unfrozen_layers_are_averaged,
        "learning_rate_schedules": check_learning_rate_schedules,
        "accumulation_change_mid_epoch": check_accumulation_change_mid_epoch,
        "average_buffers": check_average_buffers,
        "float16_sum": check_float16_sum,
        "waiting_without_spinning": check_waiting_without_spinning,
        "reduce_ops": check_reduce_ops,
        **FAULT_CHECKS,
        **({"adasum": adasum_report} if "--adasum" in sys.argv else {}),  # needs the MPI controller
        # Last, and bounded: if it hangs, the checks above are still reported and only this one fails.
        "uneven_sync_batchnorm": check_uneven_sync_batchnorm,
    }
    selected = ARGS.case.split(",") if ARGS.case else list(checks)
    report = run_checks(
        {name: checks[name] for name in selected},
        time_limits={"uneven_sync_batchnorm": 120.0},
        on_time_limit=lambda partial: write_result(OUT, hvd.rank(), partial),
    )
    write_result(OUT, hvd.rank(), report)
