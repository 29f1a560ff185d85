"""Should I turn DASO or the two-level allreduce on? Time to a target loss on an emulated cluster.

Each node is a network namespace; the link between nodes is shaped with ``tc ... tbf`` to a rate
you choose (or left unshaped), while the workers inside a node talk over unshaped loopback.
Horovod is launched across the namespaces without ssh (``horovod.runner.gloo_run.launch_gloo``
with an ``exec_command`` that enters the node's namespace). Every run of a model trains it from
the same seed on the same data with the same global batch; the metric is the wall time until
rank 0's training loss (mean of the last steps) first reaches a target, and its speedup over
flat fp32 allreduce on the same link and topology.

The models (``--model``): ``small`` and ``large`` MLPs (a handful of large tensors), ``transformer``
(a decoder-only language model of 2.7 M parameters in 260 tensors, tied embedding, on sequences of a
random Markov chain) and ``convnet`` (a ResNet with BatchNorm, 0.18 M parameters in 47 tensors, on
noisy shifted class templates); ``convnet_syncbn`` is the convnet under ``Trainer(sync_batchnorm=True)``,
which adds an allreduce of the batch statistics to every BatchNorm layer's forward and backward.

The target of a (model, topology) group comes from its reference run: flat fp32 allreduce on the
first link of the list (unshaped in the sweep) trains every epoch, and the target is the loss it
had after ``TARGET_FRACTION`` of its steps (so the other modes have epochs to spare). Every other
run stops at the end of the epoch in which it reached the target, or once it has used its time
budget, so slow links cost what they must and no more. Each run keeps per-step records (wall
time, loss, DASO phase, the strategy's ``comm_counters``) for ``scaling_model.py``.

    python benchmarks/emulated_cluster.py --sweep    # the grid -> docs/benchmarks/emulated_sweep.{txt,json,csv,png}
    python benchmarks/emulated_cluster.py --link-mbit 50 --topology 2x2 --model large --modes daso/fp16
    python benchmarks/emulated_cluster.py --link-mbit 50 --topology 2x1 --model transformer,convnet,convnet_syncbn
    python benchmarks/emulated_cluster.py --smoke    # tiny model, 2x1 at 50 Mbit/s: checks that it works

Needs root (namespaces, veth, bridge, tc); exits with code 77 and a message where they cannot be
made. Every run is bounded in time, and the namespaces, bridge and links are removed at the end,
also after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from hvd_plugins.core.sync.daso.parameter_sync import optimizer_state_to_average
from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing import reports
from hvd_plugins.testing.launch import read_rank_files, write_rank_file
from hvd_plugins.testing.netns_cluster import (
    SKIP_EXIT_CODE,
    UNSHAPED,
    ClusterUnavailable,
    NamespaceCluster,
    link_label,
    parse_link,
    run_on_cluster,
    shaping_for,
)

MODES = (
    "allreduce/none",
    "allreduce/fp16",
    "allreduce/bf16",
    "hierarchical/none",
    "hierarchical/fp16",
    "hierarchical/bf16",
    "daso/none",
    "daso/fp16",
    "daso/bf16",
    "daso+state/bf16",
    "hierarchical+zero1/none",
    "hierarchical+zero2/none",
)
"""``sync/compression``; ``+zero1``/``+zero2``: sharded inside the node (``shard="optimizer"``/``"gradients"``);
``daso+state``: DASO's closing syncs send the optimizer state in the downcast type too."""
SHARD_TAGS = {"zero1": "optimizer", "zero2": "gradients"}
DASO_STATE_TAG = "state"
BASELINE = "allreduce/none"
SWEEP_MODES = ("allreduce/none", "allreduce/fp16", "hierarchical/none", "daso/fp16")
TARGET_FRACTION = 0.75
"""The target is the loss the reference run has after this share of its steps."""
LOSS_WINDOW = 8
STARTUP_ALLOWANCE_S = 120.0
"""Added to a run's training budget for its hard limit: process start, imports, rendezvous, validation."""


# ------------------------------------------------------------------------------------------ what runs
@dataclass(frozen=True)
class Model:
    """A module on its synthetic task; ``global_batch`` is split evenly over the workers.

    ``arch`` and ``size`` name the module (``bench.build_module(arch, lr, **size)``); ``size`` is kept
    as (name, value) pairs so that a model stays hashable and travels to the workers as JSON.
    """

    name: str
    arch: str
    """``mlp``, ``transformer`` or ``convnet`` (``bench.ARCHITECTURES``)."""
    size: tuple[tuple[str, Any], ...]
    train_samples: int
    val_samples: int
    global_batch: int
    lr: float
    epochs: int
    sync_batchnorm: bool = False
    """Train under ``Trainer(sync_batchnorm=True)``: BatchNorm statistics over the global batch."""

    @property
    def sizes(self) -> dict[str, Any]:
        return dict(self.size)

    def module(self) -> bench.SyntheticTaskModule:
        return bench.build_module(self.arch, lr=self.lr, **self.sizes)

    @property
    def parameters(self) -> int:
        return bench.parameter_count(self.module())

    def describe(self) -> str:
        text = bench.describe(self.arch, **self.sizes)
        return text + (", sync_batchnorm=True" if self.sync_batchnorm else "")

    @staticmethod
    def from_dict(values: dict[str, Any]) -> Model:
        size = tuple((key, tuple(value) if isinstance(value, list) else value) for key, value in values["size"])
        return Model(**(values | {"size": size}))


def _mlp(name: str, features: int, hidden: tuple[int, ...], classes: int, **rest: Any) -> Model:
    return Model(name, "mlp", (("features", features), ("hidden", hidden), ("classes", classes)), **rest)


CONVNET = Model("convnet", "convnet", (("channels", (16, 32, 64)), ("blocks", 2), ("classes", 10)),
                train_samples=1024, val_samples=512, global_batch=64, lr=0.05, epochs=4)  # fmt: skip
MODELS = {
    # 4.8 k parameters (19 KB): a step's few collective rounds cost more than its bytes, even at 50 Mbit/s.
    "small": _mlp("small", features=64, hidden=(64,), classes=10, train_samples=2048, val_samples=1024,
                  global_batch=128, lr=0.05, epochs=6),
    # 0.8 M parameters (3.2 MB of fp32 gradients): on a slow link a flat allreduce takes many times the
    # step's compute, so bytes on the link dominate.
    "large": _mlp("large", features=256, hidden=(1024, 512), classes=10, train_samples=2048, val_samples=1024,
                  global_batch=128, lr=0.02, epochs=6),
    # 2.7 M parameters in 260 tensors (10.7 MB of fp32 gradients), embeddings and LayerNorm; AdamW. About
    # 0.3 s of compute per step on an idle core at 2 workers: the most bytes and tensors per step here.
    # Short epochs (8 steps), so that DASO's one warmup epoch is a sixth of the run, not a quarter.
    "transformer": Model("transformer", "transformer", (("vocab", 2048), ("d_model", 112), ("layers", 16),
                         ("heads", 4), ("context", 64)), train_samples=256, val_samples=256, global_batch=32,
                         lr=1e-3, epochs=6),
    # 0.18 M parameters in 47 small tensors (0.7 MB), BatchNorm; much compute per byte sent.
    "convnet": CONVNET,
    # The same under Trainer(sync_batchnorm=True): two more collectives per BatchNorm layer and step.
    "convnet_syncbn": replace(CONVNET, name="convnet_syncbn", sync_batchnorm=True),
}  # fmt: skip
SMOKE_MODEL = _mlp("smoke", features=16, hidden=(32,), classes=3, train_samples=256, val_samples=64,
                   global_batch=32, lr=0.05, epochs=3)  # fmt: skip


@dataclass(frozen=True)
class Topology:
    """``nodes`` namespaces with ``workers_per_node`` Horovod workers each."""

    nodes: int
    workers_per_node: int

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.workers_per_node}"

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node

    @staticmethod
    def parse(text: str) -> Topology:
        parts = text.lower().split("x")
        if len(parts) != 2 or not all(part.isdigit() for part in parts) or int(parts[0]) < 2 or int(parts[1]) < 1:
            raise ValueError(f"--topology {text!r} must be NODESxWORKERS with NODES >= 2, WORKERS >= 1 (e.g. 2x1, 2x2)")
        return Topology(int(parts[0]), int(parts[1]))


@dataclass(frozen=True)
class Run:
    """One training job on the cluster: everything a worker needs, written to a file it reads."""

    model: Model
    topology: Topology
    link_mbit: float | None
    mode: str
    epochs: int
    daso_warmup: int
    daso_cooldown: int
    target_loss: float
    """0: the reference run (trains every epoch and defines the target); else stop once reached."""
    budget_s: float
    """Training time after which the run stops at the end of its epoch, target reached or not."""
    data_path: str
    daso_average_state: bool = True
    """``DasoConfig.average_optimizer_state``: False keeps each node's optimizer state while cycling."""
    daso_cycling: str = "auto"
    """``DasoConfig.cycling``: "always" cycles even where cycling steps are slower than synchronous ones."""

    @property
    def per_worker_batch(self) -> int:
        return self.model.global_batch // self.topology.workers

    @staticmethod
    def from_dict(values: dict[str, Any]) -> Run:
        return Run(**(values | {"model": Model.from_dict(values["model"]), "topology": Topology(**values["topology"])}))


# ------------------------------------------------------------------------------------------ worker
def make_data(model: Model, path: Path) -> None:
    """Write the model's learnable synthetic task (train and validation samples), from a fixed seed.

    MLPs: balanced classes from scikit-learn's make_classification; the transformer and the convnet:
    ``bench.synthetic_data`` (a Markov chain's token sequences, noisy shifted class templates). Made
    once by the driver and loaded by the workers, so no worker pays for importing scikit-learn.
    """
    samples = model.train_samples + model.val_samples
    if model.arch != "mlp":
        inputs, labels = bench.synthetic_data(model.arch, samples, seed=1234, **model.sizes).tensors
        torch.save({"inputs": inputs, "labels": labels}, path)
        return
    from sklearn.datasets import make_classification

    features, classes = model.sizes["features"], model.sizes["classes"]
    inputs, labels = make_classification(
        n_samples=samples,
        n_features=features,
        n_informative=min(32, features),
        n_redundant=0,
        n_classes=classes,
        n_clusters_per_class=2,
        class_sep=1.5,
        random_state=1234,
    )
    torch.save({"inputs": torch.tensor(inputs, dtype=torch.float32), "labels": torch.tensor(labels)}, path)


def load_data(model: Model, path: Path) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    data = torch.load(path)
    cut = model.train_samples
    return (
        torch.utils.data.TensorDataset(data["inputs"][:cut], data["labels"][:cut]),
        torch.utils.data.TensorDataset(data["inputs"][cut:], data["labels"][cut:]),
    )


COUNTER_FIELDS = ("cross_node_bytes", "cross_node_calls", "node_local_bytes", "node_local_calls", "wait_seconds")


class StepRecorder(pl.Callback):
    """Per training batch: end time since training start, loss, DASO phase and the cumulative comm counters."""

    def __init__(self) -> None:
        self.start = 0.0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.phases: list[str] = []
        self.global_skips: list[int] = []
        self.counters: list[list[float]] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *rest: Any) -> None:
        self.times.append(time.perf_counter() - self.start)
        self.losses.append(float(outputs["loss"]))
        self.phases.append(_phase_of(trainer.strategy))
        schedule = getattr(getattr(trainer.strategy, "daso_sync", None), "schedule", None)
        self.global_skips.append(int(getattr(schedule, "global_skips", 1)))
        counters = getattr(trainer.strategy, "comm_counters", None)
        self.counters.append([float(getattr(counters, name, 0.0)) for name in COUNTER_FIELDS])

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def as_dict(self) -> dict[str, Any]:
        return {"times": self.times, "losses": self.losses, "phases": self.phases, "global_skips": self.global_skips,
                "counters": self.counters, "counter_fields": list(COUNTER_FIELDS)}  # fmt: skip


def _phase_of(strategy: Any) -> str:
    """``warmup`` / ``cycling`` / ``cooldown`` under DASO (read from its schedule), ``sync`` otherwise."""
    schedule = getattr(getattr(strategy, "daso_sync", None), "schedule", None)
    phase = getattr(schedule, "phase", None)
    return str(getattr(phase, "value", phase)) if phase is not None else "sync"


class StopAtTarget(pl.Callback):
    """Stop at the end of the epoch in which rank 0 reached the target, or once the time budget is used.

    Rank 0 decides and broadcasts, so every worker stops after the same epoch (a worker that
    stopped alone would leave the others waiting in a collective).
    """

    def __init__(self, recorder: StepRecorder, target_loss: float, budget_s: float) -> None:
        self.recorder, self.target_loss, self.budget_s = recorder, target_loss, budget_s
        self.reason = "epochs done"

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        reached = self.target_loss > 0 and reached_at(self.recorder.losses, self.target_loss) is not None
        decision = trainer.strategy.broadcast((reached, self.recorder.elapsed() > self.budget_s), src=0)
        if decision[0] or decision[1]:
            self.reason = "target reached" if decision[0] else "time budget used"
            trainer.should_stop = True


def worker_main(spec: Path, out: Path) -> None:
    from hvd_plugins import HorovodStrategy

    bench.one_thread_per_worker()
    run = Run.from_dict(json.loads(spec.read_text()))
    train, val = load_data(run.model, Path(run.data_path))
    sync, compression = run.mode.split("/")
    sync, _, tag = sync.partition("+")
    daso = bench.daso_settings(compression, run.daso_warmup, run.daso_cooldown) if sync == "daso" else None
    if daso is not None:
        daso["average_optimizer_state"] = run.daso_average_state
        daso["cycling"] = run.daso_cycling
        daso["downcast_optimizer_state"] = tag == DASO_STATE_TAG
    shard = SHARD_TAGS[tag] if tag in SHARD_TAGS else "none"
    strategy = HorovodStrategy(sync=sync, compression=compression, daso=daso, shard=shard)
    recorder = StepRecorder()
    stopper = StopAtTarget(recorder, run.target_loss, run.budget_s)
    trainer = bench.cpu_trainer(
        strategy, [recorder, stopper], max_epochs=run.epochs, sync_batchnorm=run.model.sync_batchnorm
    )
    module = run.model.module()
    loader = torch.utils.data.DataLoader(train, batch_size=run.per_worker_batch, shuffle=True, drop_last=True)
    trainer.fit(module, loader)
    accuracy = module.accuracy(val)  # the transformer's: of next tokens
    write_rank_file(
        out,
        trainer.global_rank,
        recorder.as_dict()
        | {
            "train_seconds": recorder.elapsed(),
            "val_accuracy": accuracy,
            "params": bench.parameter_count(module),
            "state_per_param": optimizer_state_per_parameter(trainer.optimizers, module),
            "epochs_run": trainer.current_epoch,
            "stop_reason": stopper.reason,
        },
    )


def optimizer_state_per_parameter(optimizers: Sequence[torch.optim.Optimizer], module: torch.nn.Module) -> float:
    """Optimizer state values per parameter that DASO's closing sync averages (AdamW: 2, SGD with momentum:
    1); ``scaling_model.py`` prices that sync with it."""
    values = sum(tensor.numel() for tensor in optimizer_state_to_average(optimizers))
    return values / max(1, bench.parameter_count(module))


# ------------------------------------------------------------------------------------------ launching
def launch_on_cluster(cluster: NamespaceCluster, run: Run, out: Path) -> None:
    """Launch the run's workers across the namespaces with Horovod's Gloo launcher (no ssh), bounded in time."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "run.json"
    spec.write_text(json.dumps(asdict(run)))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--spec", str(spec), "--out", str(out)]
    run_on_cluster(cluster, command, run.topology.workers_per_node, out / "logs", run.budget_s + STARTUP_ALLOWANCE_S)


# ------------------------------------------------------------------------------------------ reading results
def smoothed(losses: Sequence[float], window: int = LOSS_WINDOW) -> list[float]:
    """Mean of the last ``window`` losses at each step (fewer at the start)."""
    return [sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]


def reached_at(losses: Sequence[float], target: float, window: int = LOSS_WINDOW) -> int | None:
    """Index of the first step whose mean of the last ``window`` losses (a full window) is <= ``target``."""
    means = smoothed(losses, window)
    return next((i for i in range(window - 1, len(means)) if means[i] <= target), None)


def target_from_reference(losses: Sequence[float]) -> float:
    """The smoothed loss of the reference run after ``TARGET_FRACTION`` of its steps."""
    if len(losses) < LOSS_WINDOW:
        raise RuntimeError(f"the reference run recorded {len(losses)} steps, fewer than the loss window {LOSS_WINDOW}")
    return smoothed(losses)[max(LOSS_WINDOW, math.ceil(TARGET_FRACTION * len(losses))) - 1]


def summarize(run: Run, rank0: dict[str, Any], target: float) -> dict[str, Any]:
    """One sweep row: time to target, accuracy, and per DASO phase the mean step time, bytes and calls.

    A step's time is the gap between its end and the previous step's end, so epoch boundaries
    (DASO's closing sync, the stop decision) count in the first step of the next epoch; the first
    step of the run (setup, first collectives) is kept apart as ``first_step_s``.
    """
    times, phases, counters = rank0["times"], rank0["phases"], rank0["counters"]
    index = reached_at(rank0["losses"], target)
    phase_stats: dict[str, dict[str, float]] = {}
    for phase in dict.fromkeys(phases[1:]):
        steps = [i for i in range(1, len(times)) if phases[i] == phase]
        stats = {"steps": float(len(steps)), "step_s": sum(times[i] - times[i - 1] for i in steps) / len(steps)}
        for k, name in enumerate(COUNTER_FIELDS):
            stats[f"{name}_per_step"] = sum(counters[i][k] - counters[i - 1][k] for i in steps) / len(steps)
        stats["steps_to_target"] = float(sum(1 for i in steps if index is not None and i <= index))
        stats["syncs_per_step"] = sum(1 / rank0["global_skips"][i] for i in steps) / len(steps)
        phase_stats[phase] = stats
    return {
        "model": run.model.name,
        "topology": run.topology.label,
        "link_mbit": link_label(run.link_mbit),
        "mode": run.mode,
        "params": rank0["params"],
        "state_per_param": rank0["state_per_param"],
        "daso_average_state": run.daso_average_state,
        "workers": run.topology.workers,
        "per_worker_batch": run.per_worker_batch,
        "epochs": run.epochs,
        "daso_warmup": run.daso_warmup,
        "daso_cooldown": run.daso_cooldown,
        "epochs_run": rank0["epochs_run"],
        "steps": len(times),
        "steps_per_epoch": len(times) / max(1, rank0["epochs_run"]),
        "target_loss": target,
        "steps_to_target": None if index is None else index + 1,
        "time_to_target_s": None if index is None else times[index],
        "first_step_s": times[0] if times else None,
        "train_s": rank0["train_seconds"],
        "mean_step_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        "val_accuracy": rank0["val_accuracy"],
        "stop_reason": rank0["stop_reason"],
        "phases": phase_stats,
    }


def median_attempt(attempts: Sequence[dict[str, Any]], failed: int = 0) -> dict[str, Any]:
    """The row of repeated runs: the run with the median time to target (runs that missed it count as
    slowest; of an even number, the faster middle one), with every run's time to target and mean
    step kept beside it, and how many runs failed (``failed_repeats``).

    One run of a short row can be many times slower than the next (a busy moment on a shared
    machine); the median of three is what the row is reported and fitted by. ``reference`` stays
    the kept run's own: only the group's first run trains every epoch to set the target.
    """
    ordered = sorted(attempts, key=lambda row: row["time_to_target_s"] or math.inf)
    kept = dict(ordered[(len(ordered) - 1) // 2])
    kept["repeats"] = [
        {"time_to_target_s": row["time_to_target_s"], "mean_step_s": row["mean_step_s"]} for row in attempts
    ]
    kept["failed_repeats"] = failed
    return kept


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Speedup of time to target and accuracy difference against flat fp32 allreduce, same model/topology/link."""
    baselines = {(r["model"], r["topology"], r["link_mbit"]): r for r in rows if r["mode"] == BASELINE}
    for row in rows:
        base = baselines.get((row["model"], row["topology"], row["link_mbit"]))
        both = base is not None and base["time_to_target_s"] and row["time_to_target_s"]
        row["speedup"] = base["time_to_target_s"] / row["time_to_target_s"] if both else None
        row["acc_diff_pts"] = 100 * (row["val_accuracy"] - base["val_accuracy"]) if base else None


# ------------------------------------------------------------------------------------------ the grid
@dataclass(frozen=True)
class Grid:
    models: tuple[Model, ...]
    topologies: tuple[Topology, ...]
    links: tuple[float | None, ...]
    """The first link's flat fp32 run is the reference that defines the target."""
    modes: tuple[str, ...]
    epochs: int | None
    daso_warmup: int
    daso_cooldown: int
    budget_s: float
    repeats: int = 1
    """Runs per row; the row is the run with the median time to target (``median_attempt``)."""
    daso_average_state: bool = True
    daso_cycling: str = "auto"

    def modes_for(self, topology: Topology, model: Model) -> list[str]:
        """Flat fp32 first (it is the baseline); the two-level allreduce only where a node has >= 2 workers;
        no DASO under ``sync_batchnorm=True``, which HorovodStrategy refuses (the training diverges)."""
        wanted = [BASELINE] + [m for m in self.modes if m != BASELINE]
        return [m for m in wanted if not (m.startswith("hierarchical") and topology.workers_per_node == 1)
                and not (m.startswith("daso") and model.sync_batchnorm)]  # fmt: skip

    def runs(self) -> int:
        rows = sum(len(self.links) * len(self.modes_for(t, m)) for t in self.topologies for m in self.models)
        return rows * self.repeats


def run_grid(grid: Grid, workdir: Path, log: Any = print) -> list[dict[str, Any]]:
    """Every run of the grid on one cluster; a failed run is reported and skipped, never hides the rest."""
    rows: list[dict[str, Any]] = []
    nodes = max(t.nodes for t in grid.topologies)
    started = time.monotonic()
    with NamespaceCluster(nodes=nodes, shaping="") as cluster:
        cluster.check_reachable(sys.executable)
        log(f"cluster: {nodes} namespaces on {cluster.subnet}; {grid.runs()} runs")
        for model in grid.models:
            for topology in grid.topologies:
                rows += _run_group(cluster, grid, model, topology, workdir, lambda: time.monotonic() - started, log)
    add_comparisons(rows)
    return rows


def _run_group(
    cluster: NamespaceCluster, grid: Grid, model: Model, topology: Topology, workdir: Path, clock: Any, log: Any
) -> list[dict[str, Any]]:
    """One model on one topology over every link; the first run (flat fp32, first link) sets the target.

    With ``grid.repeats`` > 1 the modes of a link take turns (every mode once, then again), so a
    machine that slows down during the group slows every mode alike instead of the last one.
    """
    rows: list[dict[str, Any]] = []
    target = 0.0
    workdir.mkdir(parents=True, exist_ok=True)
    data_path = workdir / f"{model.name}_data.pt"
    make_data(model, data_path)
    for link in grid.links:
        cluster.reshape(shaping_for(link))
        attempts: dict[str, list[dict[str, Any]]] = {mode: [] for mode in grid.modes_for(topology, model)}
        failed = dict.fromkeys(attempts, 0)
        for repeat in range(grid.repeats):
            for mode in attempts:
                name = f"{model.name} {topology.label} {link_label(link):>8} {mode:<17}"
                label = f"{model.name}_{topology.label}_{link_label(link)}_{mode.replace('/', '_')}"
                run = Run(model, topology, link, mode, grid.epochs or model.epochs, grid.daso_warmup,
                          grid.daso_cooldown, target_loss=target, budget_s=grid.budget_s,
                          data_path=str(data_path), daso_average_state=grid.daso_average_state,
                          daso_cycling=grid.daso_cycling)  # fmt: skip
                out = workdir / (label if grid.repeats == 1 else f"{label}_r{repeat + 1}")
                try:
                    launch_on_cluster(cluster, run, out)
                    rank0 = read_rank_files(out).get(0)
                    if rank0 is None:
                        raise RuntimeError("rank 0 wrote no result")
                except RuntimeError as error:
                    log(f"  {name} FAILED: {str(error)[:2000]}")
                    failed[mode] += 1
                    if target == 0:
                        log(f"  {name} was the reference run of its group: skipping the group")
                        return rows
                    continue
                reference = target == 0
                if reference:
                    target = target_from_reference(rank0["losses"])
                attempts[mode].append(summarize(run, rank0, target) | {"reference": reference})
                row = attempts[mode][-1]
                reached = row["time_to_target_s"]
                log(f"  {name} {row['steps']:4d} steps, "
                    f"{f'target at {reached:.1f} s' if reached else 'target not reached':<20} "
                    f"mean step {1000 * (row['mean_step_s'] or 0):7.1f} ms, val acc {row['val_accuracy']:.3f} "
                    f"({row['stop_reason']}{', reference' if reference else ''}; {clock():.0f} s elapsed)")  # fmt: skip
        rows += [median_attempt(runs, failed[mode]) for mode, runs in attempts.items() if runs]
    return rows


# ------------------------------------------------------------------------------------------ writing results
def report(rows: list[dict[str, Any]], grid: Grid) -> str:
    """The sweep's table: one row per run, speedup and accuracy difference against flat fp32 allreduce."""
    table_rows = []
    for r in rows:
        reached = r["time_to_target_s"]
        cross = sum(p["cross_node_bytes_per_step"] * p["steps"] for p in r["phases"].values())
        steps = sum(p["steps"] for p in r["phases"].values())
        table_rows.append([
            r["model"], r["topology"], r["link_mbit"], r["mode"],
            r["steps_to_target"] or "-", f"{reached:.1f}" if reached else "not reached",
            f"{1000 * r['mean_step_s']:.1f}" if r["mean_step_s"] else "-",
            f"{cross / steps / 1e3:.1f}" if steps else "-",
            f"{100 * r['val_accuracy']:.2f}",
            "(baseline)" if r["mode"] == BASELINE else (f"{r['speedup']:.2f}x" if r["speedup"] else "-"),
            f"{r['acc_diff_pts']:+.2f}" if r["acc_diff_pts"] is not None else "-",
        ] + ([" / ".join([*(f"{a['time_to_target_s']:.1f}" if a["time_to_target_s"] else "-" for a in r["repeats"]),
                          *["failed"] * r["failed_repeats"]])] if grid.repeats > 1 else []))  # fmt: skip
    models = ", ".join(f"{m.name} {m.describe()} ({m.parameters:,} parameters, global batch {m.global_batch}, "
                       f"{grid.epochs or m.epochs} epochs)" for m in grid.models)  # fmt: skip
    header = (
        f"emulated_cluster sweep: NODESxWORKERS network namespaces, the link between nodes shaped with tc tbf "
        f"(Mbit/s per node, each direction), workers inside a node on loopback. {models}; the global batch is "
        f"split over the workers; DASO: {grid.daso_warmup} warmup and "
        f"{grid.daso_cooldown} cooldown epochs, cycling in between{'' if grid.daso_average_state else PER_NODE_NOTE}"
        f" (cycling={grid.daso_cycling!r})"
        f". Target per model and topology: the training "
        f"loss (rank 0, mean of last {LOSS_WINDOW} steps) flat fp32 allreduce had after {TARGET_FRACTION:.0%} of its "
        f"steps on the first link ({link_label(grid.links[0])}); a run stops at the end of the epoch in which it "
        f"reached it, or after {grid.budget_s:.0f} s of training. speedup = flat fp32 allreduce's time to target "
        f"/ this run's, same model, topology and link; cross KB/step = bytes each worker handed to cross-node "
        f"collectives per step (strategy.comm_counters)."
        + (f" Each row ran {grid.repeats} times, the modes of a link taking turns, and reports the run with the "
           f"median time to target (of an even number of runs, the faster middle one); 'each run s' lists every "
           f"run's time to target." if grid.repeats > 1 else "")
    )  # fmt: skip
    headers = ["model", "topo", "link Mbit/s", "mode", "steps to target", "s to target", "step ms",
               "cross KB/step", "val acc %", "speedup", "acc diff (pts)"]  # fmt: skip
    headers += ["each run s"] if grid.repeats > 1 else []
    return f"{header}\n\n{format_table(headers, table_rows)}"


def write_records(rows: list[dict[str, Any]], measured: dict[str, str], json_path: Path, csv_path: Path) -> None:
    """All of each run's numbers as JSON (read by scaling_model.py), and one CSV row per run and phase.

    ``measured`` (date, machine, command) travels in the JSON, so the model fitted to it can say whose numbers
    it fitted.
    """
    records = {"measured": measured, "loss_window": LOSS_WINDOW, "target_fraction": TARGET_FRACTION, "runs": rows}
    json_path.write_text(json.dumps(records, indent=1) + "\n")
    flat_keys = [k for k in rows[0] if k != "phases"] if rows else []
    phase_keys = sorted({k for r in rows for p in r["phases"].values() for k in p})
    with open(csv_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*flat_keys, "phase", *phase_keys])
        for r in rows:
            for phase, stats in r["phases"].items():
                cells = [json.dumps(r[k]) if isinstance(r[k], list | dict) else r[k] for k in flat_keys]
                writer.writerow(cells + [phase] + [stats.get(k, "") for k in phase_keys])


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Speedup over flat fp32 allreduce against link rate; one panel per model, one line per mode x topology."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shaped = sorted({float(r["link_mbit"]) for r in rows if r["link_mbit"] != UNSHAPED})
    unshaped_x = (max(shaped) if shaped else 100.0) * 5

    def x_of(label: str) -> float:
        return unshaped_x if label == UNSHAPED else float(label)

    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, axes_list = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for axes, model in zip(axes_list[0], models, strict=True):
        lines = dict.fromkeys((r["mode"], r["topology"]) for r in rows if r["model"] == model and r["mode"] != BASELINE)
        for mode, topology in lines:
            points = sorted(
                (x_of(r["link_mbit"]), r["speedup"])
                for r in rows
                if (r["model"], r["mode"], r["topology"]) == (model, mode, topology) and r["speedup"]
            )
            if points:  # colour by mode, line style by topology
                style = "--s" if topology.endswith("x1") else "-o"
                color = f"C{MODES.index(mode)}"
                axes.plot(*zip(*points, strict=True), style, color=color, label=f"{mode} {topology}")
        axes.axhline(1.0, color="gray", linestyle=":", label="flat fp32 allreduce")
        axes.set_xscale("log")
        ticks = [*shaped, unshaped_x]
        axes.set_xticks(ticks, [f"{t:g}" for t in shaped] + [UNSHAPED])
        axes.minorticks_off()
        axes.set_xlabel("link between nodes (Mbit/s)")
        axes.set_ylabel("speedup of time to target over flat fp32")
        axes.set_title(f"{model} model")
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ------------------------------------------------------------------------------------------ command line
def _split(text: str | None) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()] if text else []


PER_NODE_NOTE = ", each node keeping its own optimizer state while cycling (average_optimizer_state=False)"


def report_stem(models: Sequence[Model], daso_average_state: bool = True) -> str:
    """``emulated_sweep`` for MLPs (the sweep's, or the smoke model), ``emulated_sweep_<model>_...`` for others, so
    each model family's report keeps its own files in ``docs/benchmarks``; runs of DASO keeping per-node
    optimizer state are ``daso_per_node_state_<model>_...`` (``scaling_model.py`` fits emulated_sweep*)."""
    names = [model.name for model in models]
    if not daso_average_state:
        return "_".join(["daso_per_node_state", *names])
    mlps_only = all(model.arch == "mlp" for model in models)  # the MLP sweep, a part of it, or the smoke model
    return "emulated_sweep" if mlps_only else "_".join(["emulated_sweep", *names])


def build_grid(args: argparse.Namespace) -> Grid:
    """The runs the flags ask for; ``--sweep`` and ``--smoke`` give the defaults of each flag left out."""
    sweep_modes = ",".join(SWEEP_MODES)
    if args.smoke:
        smoke_modes = "allreduce/none,hierarchical/none,daso/fp16"
        defaults = {"model": "smoke", "topology": "2x1", "link_mbit": "50", "modes": smoke_modes}
    elif args.sweep:
        defaults = {"model": "small,large", "topology": "2x1,2x2", "link_mbit": "unshaped,200,50", "modes": sweep_modes}
    else:
        defaults = {"model": "large", "topology": "2x2", "link_mbit": "200", "modes": sweep_modes}
    known_models = {**MODELS, "smoke": SMOKE_MODEL}
    models = []
    for name in _split(args.model or defaults["model"]):
        if name not in known_models:
            raise ValueError(f"--model {name!r} is not known; choose from {list(MODELS)}")
        models.append(known_models[name])
    modes = _split(args.modes or defaults["modes"])
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes {unknown} not known; choose from {list(MODES)}")
    epochs = args.epochs or (SMOKE_MODEL.epochs if args.smoke else None)
    for model in models:
        total = epochs or model.epochs
        if total < 1 or args.daso_warmup < 0 or args.daso_cooldown < 0 or args.daso_warmup + args.daso_cooldown > total:
            raise ValueError(f"--daso-warmup {args.daso_warmup} + --daso-cooldown {args.daso_cooldown} must be >= 0 "
                             f"and fit in the {total} epochs of model {model.name!r} (--epochs)")  # fmt: skip
    if args.run_budget <= 0:
        raise ValueError(f"--run-budget {args.run_budget} must be > 0 seconds")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be >= 1")
    topologies = tuple(dict.fromkeys(Topology.parse(t) for t in _split(args.topology or defaults["topology"])))
    for model in models:
        for topology in topologies:
            if model.global_batch % topology.workers:
                raise ValueError(f"--topology {topology.label}: the global batch {model.global_batch} of model "
                                 f"{model.name!r} does not split evenly over {topology.workers} workers")  # fmt: skip
    return Grid(
        models=tuple(models),
        topologies=topologies,
        links=tuple(dict.fromkeys(parse_link(link) for link in _split(args.link_mbit or defaults["link_mbit"]))),
        modes=tuple(modes),
        epochs=epochs,
        daso_warmup=args.daso_warmup,
        daso_cooldown=args.daso_cooldown,
        daso_average_state=not args.daso_per_node_state,
        daso_cycling=args.daso_cycling,
        budget_s=args.run_budget,
        repeats=args.repeats,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line; ``build_grid`` turns what it parses into the runs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the grid: models small,large x topologies 2x1,2x2 x links unshaped,200,50 x the 4 "
        "sweep modes (the small model at unshaped and 50 only); writes emulated_sweep.*",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model, 3 epochs, 2x1 at 50 Mbit/s (with --topology 2x2 also the two-level allreduce)",
    )
    parser.add_argument(
        "--link-mbit",
        help="comma-separated link rates between nodes in Mbit/s, or 'unshaped' "
        "(the first one's flat fp32 run sets the target; default 200)",
    )
    parser.add_argument("--topology", help="comma-separated NODESxWORKERS (default 2x2; 2x1 needs only 2 cores)")
    parser.add_argument(
        "--model",
        help=f"comma-separated, from {list(MODELS)} (default large): MLPs, a Transformer LM, a ResNet with "
        "BatchNorm, and that ResNet under Trainer(sync_batchnorm=True)",
    )
    parser.add_argument("--epochs", type=int, help="epochs per run (default: the model's: 6, the convnet's 4)")
    parser.add_argument("--daso-warmup", type=int, default=1, help="DASO warmup epochs (default 1)")
    parser.add_argument("--daso-cooldown", type=int, default=1, help="DASO cooldown epochs (default 1)")
    parser.add_argument(
        "--daso-per-node-state",
        action="store_true",
        help="DASO with average_optimizer_state=False (each node keeps its optimizer state while cycling); "
        "the files are named daso_per_node_state_<models>.*",
    )
    parser.add_argument(
        "--max-step-ratio",
        type=float,
        help="exit 1 when a node-aware mode's mean step on an unshaped link exceeds flat fp32's by more than this "
        "factor (the CI smoke uses 1.5: on a fast link they must not cost more than flat; the margin absorbs a "
        "2-core machine's noise and the tiny model's cycling epoch, which it keeps)",
    )
    parser.add_argument(
        "--daso-cycling",
        choices=("auto", "always"),
        default="auto",
        help="DasoConfig.cycling: 'auto' (default) stops cycling where its steps are slower than synchronous "
        "ones; 'always' cycles whatever the link",
    )
    parser.add_argument(
        "--modes", help=f"comma-separated from {list(MODES)}; flat fp32 always runs (default: {','.join(SWEEP_MODES)})"
    )
    parser.add_argument(
        "--run-budget",
        type=float,
        default=150.0,
        help="seconds of training after which a run stops at its epoch's end (default 150)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per row; each row reports the run with the median time to target and lists every run's (default 1)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        help="write emulated_sweep.{txt,json,csv,png} here (default with --sweep: docs/benchmarks); for models "
        "other than the MLPs the files are named after them, e.g. emulated_sweep_transformer.txt",
    )
    parser.add_argument(
        "--logs-dir",
        type=Path,
        help="keep every run's worker logs under this folder (default: a temporary folder, removed afterwards)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.spec, args.out)
        return 0
    try:
        grid = build_grid(args)
    except ValueError as error:
        parser.error(str(error))
    if args.sweep and not args.model and not args.link_mbit:
        small = next(m for m in grid.models if m.name == "small")
        grids = [replace(grid, models=(small,), links=(None, 50.0)), replace(grid, models=(MODELS["large"],))]
    else:
        grids = [grid]
    results_dir = args.results_dir or (reports.docs_dir(__file__) if args.sweep else None)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    keep = contextlib.nullcontext(str(args.logs_dir)) if args.logs_dir else None
    workdir = keep or tempfile.TemporaryDirectory(prefix="hvd_emulated_")
    with workdir as tmp:
        try:
            for index, part in enumerate(grids):
                rows += run_grid(part, Path(tmp) / f"grid{index}", log=lambda line: print(line, flush=True))
        except ClusterUnavailable as reason:
            print(f"SKIPPED: the emulated cluster cannot be built here: {reason}")
            return SKIP_EXIT_CODE
        except KeyboardInterrupt:
            print("interrupted: workers stopped, namespaces, bridge and links removed", flush=True)
            return 130
    if not rows:
        print("no run finished; see the errors above", file=sys.stderr)
        return 1
    models = tuple(dict.fromkeys(m for g in grids for m in g.models))
    text = report(rows, replace(grid, models=models))
    print(f"\n{text}\n\nsweep wall time: {time.monotonic() - started:.0f} s")
    if results_dir is not None:
        stem = report_stem(models, grid.daso_average_state)
        reports.write_report(results_dir / f"{stem}.txt", text, __file__, argv)
        measured = {
            "date": datetime.date.today().isoformat(),
            "machine": reports.machine(),
            "command": reports.command_line(__file__, argv),
        }
        write_records(rows, measured, results_dir / f"{stem}.json", results_dir / f"{stem}.csv")
        plot(rows, results_dir / f"{stem}.png")
        print(f"written: {results_dir}/{stem}.{{txt,json,csv,png}}")
    slow = steps_over_margin(rows, args.max_step_ratio) if args.max_step_ratio else []
    for line in slow:
        print(f"too slow: {line}")
    return 1 if slow else 0


NODE_AWARE = ("hierarchical", "daso")


def steps_over_margin(rows: Sequence[dict[str, Any]], ratio: float) -> list[str]:
    """The node-aware rows on an unshaped link whose mean step exceeds flat fp32's of the same model and
    topology by more than ``ratio`` (``--max-step-ratio``): where the link is fast they must not cost more."""
    where = ("model", "topology", "link_mbit")
    flat = {tuple(r[k] for k in where): r["mean_step_s"] for r in rows if r["mode"] == "allreduce/none"}
    found = []
    for row in rows:
        baseline = flat.get(tuple(row[k] for k in where))
        node_aware = row["mode"].split("/")[0].split("+")[0] in NODE_AWARE
        step = row["mean_step_s"]
        if node_aware and row["link_mbit"] == "unshaped" and baseline and step and step > ratio * baseline:
            found.append(
                f"{row['model']} {row['topology']} {row['mode']}: mean step {1e3 * step:.1f} ms, "
                f"{step / baseline:.2f}x flat fp32's {1e3 * baseline:.1f} ms (margin {ratio:g}x)"
            )
    return found


if __name__ == "__main__":
    sys.exit(main())
