"""What the benchmark scripts share: launching their jobs, small statistics, the model, data and Trainer.

Every benchmark is one script that plays two roles: run without ``--worker`` it is the driver
(it launches jobs, gathers what each rank wrote and prints tables); run with ``--worker`` it is
one training process. Workers write ``rank<N>.json`` into the ``--out`` folder they are given.
The scripts import only this package, so each runs as ``python benchmarks/<name>.py`` and as
``python -m benchmarks.<name>`` alike.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from hvd_plugins.testing import launch
from hvd_plugins.testing.launch import JobResult

TWO_EMULATED_NODES = "localhost:2,127.0.0.1:2"
"""Two hosts that name this machine twice: Horovod sees 2 nodes of 2 workers."""


# ---------------------------------------------------------------------------------------- launching
def horovodrun(
    script_args: Sequence[str],
    out_dir: Path,
    np: int = 2,
    hosts: str | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> JobResult:
    """``horovodrun -np N -H hosts --gloo python <script_args> --out out_dir``."""
    return launch.horovodrun(
        [sys.executable, *script_args], np=np, hosts=hosts, out_dir=out_dir, timeout=timeout, env=env
    )


def torchrun(script_args: Sequence[str], out_dir: Path, nproc: int = 2, timeout: float = 300) -> JobResult:
    """``python -m torch.distributed.run --nproc_per_node N <script_args> --out out_dir`` (one node)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += [*script_args, "--out", str(out_dir)]
    return launch.run_bounded(command, timeout, out_dir=out_dir)


def daso_settings(compression: str, warmup_epochs: int, cooldown_epochs: int) -> dict[str, Any]:
    """DASO knobs for a benchmark row whose compression column also picks the cross-node wire type.

    ``"fp16"`` sends the parameters as float16, ``"none"`` as float32, so a row's bytes follow its label.
    """
    downcast = "fp16" if compression == "fp16" else "fp32"
    return {"warmup_epochs": warmup_epochs, "cooldown_epochs": cooldown_epochs, "downcast": downcast}


# ---------------------------------------------------------------------------------------- numbers
def median(values: Sequence[float]) -> float:
    """The median as a float; raises on no values (a benchmark row without a measurement is a bug)."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def steps_per_second(step_end_times: Sequence[float], warmup_steps: int) -> float:
    """Rate over the steps after the first ``warmup_steps`` (startup and first steps excluded)."""
    if len(step_end_times) < warmup_steps + 2:
        raise ValueError(f"need more than {warmup_steps + 1} timed steps, got {len(step_end_times)}")
    timed = step_end_times[warmup_steps:]
    return (len(timed) - 1) / (timed[-1] - timed[0])


def target_verdict(measured: float, target: float, higher_is_better: bool = True) -> str:
    """``met`` or ``not met``: the word a report prints next to a target."""
    met = measured >= target if higher_is_better else measured <= target
    return "met" if met else "not met"


# ---------------------------------------------------------------------------------------- models and data
def mlp(in_features: int, hidden: Sequence[int], classes: int, seed: int = 0) -> nn.Sequential:
    """A plain ReLU MLP initialised from ``seed``, so every worker and variant starts from the same weights.

    Its parameter count grows with ``hidden``, so communication can be made to matter.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class Classifier(pl.LightningModule):
    """The benchmarks' LightningModule: an ``mlp`` trained with cross-entropy and SGD."""

    def __init__(self, features: int, hidden: Sequence[int], classes: int, lr: float, momentum: float = 0.0) -> None:
        super().__init__()
        self.net = mlp(features, hidden, classes)
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class StepClock(pl.Callback):
    """When each training batch ended, in seconds since training started, and with ``losses`` its loss."""

    def __init__(self, losses: bool = False) -> None:
        self.record_losses = losses
        self.times: list[float] = []
        self.losses: list[float] = []
        self.total = 0.0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *rest: Any) -> None:
        self.times.append(time.perf_counter() - self.start)
        if self.record_losses:
            self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.total = time.perf_counter() - self.start


def cpu_trainer(strategy: Any, callbacks: Sequence[pl.Callback], devices: int = 1, max_epochs: int = 1) -> pl.Trainer:
    """A Trainer on CPU that only trains: no logger, checkpoints, progress bar, summary or validation."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )


def parameter_count(model: nn.Module) -> int:
    """Trainable parameters: what a gradient sync moves."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def random_classification(samples: int, features: int, classes: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Synthetic inputs and labels, identical on every worker (same seed)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(inputs, labels)


def one_thread_per_worker() -> None:
    """Workers share few cores; one intra-op thread each keeps them from fighting over them."""
    torch.set_num_threads(1)
