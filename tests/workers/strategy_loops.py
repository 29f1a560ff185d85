"""Lightning's loops and the strategy's collectives under HorovodStrategy: reduce, gather, metrics, the
validation, test and predict loops, precision, checkpoints, ranks with uneven data."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks, out_dir
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import REGRESSION_FEATURES, MetricClassifier, Regression, regression_data
from strategy_common import all_equal, digest, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import AtomicCheckpointIO

checks = Checks()


@checks.register
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


@checks.register
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


@checks.register
def check_waiting_without_spinning() -> dict[str, Any]:
    """A blocking collective that waits for a late rank (Horovod's synchronize, in the wheel
    hvd-build-horovod builds) sleeps instead of spinning: the waiting thread uses little CPU."""
    late_seconds = 1.0
    if hvd.rank() == 0:
        time.sleep(late_seconds)
    started, cpu_started = time.monotonic(), time.thread_time()
    hvd.allreduce(torch.ones(4), name="check.wait_without_spinning")
    return {"waited_seconds": time.monotonic() - started, "thread_cpu_seconds": time.thread_time() - cpu_started}


@checks.register
def check_idle_loop() -> dict[str, Any]:
    """Horovod's loop (the build's idle loop; the job sets HOROVOD_IDLE_CYCLE_TIME=2000) runs about no
    round while nothing is queued, and a rank whose collective comes late is answered at once: its
    enqueue wakes its loop, and the rank that waited finishes with it."""
    timeline = out_dir() / "idle_loop_timeline.json"  # rank 0, the coordinator, writes it
    hvd.start_timeline(str(timeline), mark_cycles=True)
    hvd.allreduce(torch.ones(1), name="check.idle.first")  # a round: the timeline now records
    time.sleep(1.0)
    hvd.allreduce(torch.ones(1), name="check.idle.second")
    hvd.stop_timeline()
    late_seconds = 0.5
    if hvd.rank() == 0:
        time.sleep(late_seconds)
    started = time.monotonic()
    hvd.allreduce(torch.ones(1), name="check.idle.late")
    finished = time.time()
    text = timeline.read_text() if hvd.rank() == 0 else ""
    return {
        "idle_env": os.environ.get("HOROVOD_IDLE_CYCLE_TIME"),
        "recorded": "check.idle.first" in text and "check.idle.second" in text,
        # timings and counts that vary between runs are named *seconds: the packages' comparison skips them
        "rounds_in_idle_seconds": text.count("CYCLE_START"),
        "answered_seconds": time.monotonic() - started,
        "finished_at_seconds": finished,
    }


@checks.register
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


@checks.register
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


@checks.register
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


class CountingCheckpointIO(AtomicCheckpointIO):
    saves = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        CountingCheckpointIO.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


@checks.register
def check_checkpoint_resume() -> dict[str, Any]:
    """Rank 0 alone writes; resuming gives every rank the checkpoint's weights and optimizer state."""
    directory = Path(hvd.broadcast_object(str(out_dir() / "checkpoints"), root_rank=0))
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


@checks.register
def check_uneven_data() -> dict[str, Any]:
    """Ranks with different numbers of batches finish without hanging (Horovod join)."""
    n = 40 if hvd.rank() == 0 else 24
    x, y = regression_data(n, seed=10 + hvd.rank())
    model = Regression()
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    t = trainer(max_epochs=2, use_distributed_sampler=False, limit_val_batches=2)
    t.fit(model, loader, loader)
    return {"batches": t.num_training_batches, "ranks_identical": all_equal(digest(model)), "steps": t.global_step}
