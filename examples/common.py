"""Plumbing shared by the examples: flags -> HorovodStrategy, logging, plots.

Kept apart so each example script reads top to bottom as data, model, Trainer, result.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from hvd_plugins import DasoConfig, HorovodStrategy
from hvd_plugins.core.comm.compression import COMPRESSORS
from hvd_plugins.core.config import GRADIENT_OPS, HIERARCHICAL_IMPLS, SYNC_MODES

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_DASO_HELP = {
    "warmup_epochs": "epochs at the start with gradients averaged over all workers every step",
    "cooldown_epochs": "epochs at the end with gradients averaged over all workers every step",
    "stability_level": "relative loss improvement below which an epoch counts as not improving",
    "max_global_skips": "most batches between two cross-node syncs",
    "skip_reduction_factor": "divisor applied to the skips when the loss has stabilised",
    "local_skip_factor": "batches_to_wait on a reset is max_global_skips // this",
    "stable_epochs": "plateau patience: the skips shrink on the (N+1)-th epoch in a row without improvement",
    "sending_chunk_size": "largest number of elements in one cross-node message",
    "downcast": "wire type of the cross-node parameters",
    "verbose": "print schedule changes on rank 0",
}

# Examples run on tiny data sets with few workers; Lightning's advice about loader workers is noise here.
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*number of training batches.*is smaller than the logging interval.*")


def add_training_flags(parser: argparse.ArgumentParser, epochs: int, batch_size: int, lr: float) -> None:
    """Flags every example shares: the loop, the output folder and the seed."""
    group = parser.add_argument_group("training")
    group.add_argument("--epochs", type=int, default=epochs, help="training epochs (default %(default)s)")
    group.add_argument(
        "--batch-size", type=int, default=batch_size, help="samples per worker per step (default %(default)s)"
    )
    group.add_argument("--lr", type=float, default=lr, help="learning rate before --scale-lr (default %(default)s)")
    group.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches accumulated into one optimizer step (default 1)"
    )
    group.add_argument("--precision", choices=PRECISIONS, default="32-true", help="Trainer precision (default 32-true)")
    group.add_argument("--seed", type=int, default=0, help="seed for data split, init and shuffling (default 0)")
    group.add_argument(
        "--out-dir", type=Path, default=Path("runs"), help="where the CSV log and the plot go (default runs/)"
    )
    group.add_argument("--no-progress-bar", action="store_true", help="hide the progress bar (logs stay)")
    group.add_argument(
        "--monitor",
        action="store_true",
        help="add PeakMemoryMonitor and CommunicationMonitor (tables on rank 0, values in the CSV log)",
    )
    group.add_argument(
        "--timeline-steps",
        nargs=2,
        type=int,
        metavar=("START_STEP", "STOP_STEP"),
        help="record a Horovod timeline of these optimizer steps to <out-dir>/timeline.json",
    )


def add_strategy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per HorovodStrategy argument, and one per DASO knob (``--daso-<field>``)."""
    group = parser.add_argument_group("HorovodStrategy")
    group.add_argument("--compression", choices=sorted(COMPRESSORS), default="none", help="gradients on the wire")
    group.add_argument("--sync", choices=SYNC_MODES, default="allreduce", help="how gradients/parameters are synced")
    group.add_argument("--op", choices=GRADIENT_OPS, default="average", help="reduction of the gradients")
    group.add_argument("--scale-lr", action="store_true", help="multiply the learning rate by the number of workers")
    group.add_argument("--gradient-predivide-factor", type=float, default=1.0, help="split the averaging (op=average)")
    group.add_argument("--hierarchical-impl", choices=HIERARCHICAL_IMPLS, default="portable")
    group.add_argument("--compress-node-local", action="store_true", help="sync=hierarchical: compress local legs too")
    group.add_argument("--sync-batchnorm", action="store_true", help="BatchNorm statistics over all workers")
    group.add_argument("--no-average-buffers", action="store_true", help="keep each worker's BatchNorm running stats")
    group.add_argument("--bucket-mb", type=float, default=32.0, help="gradient bucket size of sync=hierarchical")
    group.add_argument(
        "--stall-timeout",
        type=_seconds_or_auto,
        default="auto",
        help="end the job when a rank is missing this many seconds (auto: horovodrun's setting, else 1800)",
    )
    group.add_argument(
        "--check-finite-gradients", action="store_true", help="stop on every rank when a gradient is NaN/Inf"
    )
    daso = parser.add_argument_group("DASO (only with --sync daso; defaults from DasoConfig)")
    for field in dataclasses.fields(DasoConfig):
        flag = "--daso-" + field.name.replace("_", "-")
        help_text = f"{_DASO_HELP.get(field.name, field.name)} (default {field.default})"
        if field.type in ("bool", bool):
            daso.add_argument(flag, action="store_true", default=None, help=help_text)
        elif field.name == "downcast":
            from hvd_plugins.core.daso.config import DOWNCAST_TYPES

            daso.add_argument(flag, choices=DOWNCAST_TYPES, default=None, help=help_text)
        else:
            daso.add_argument(flag, type=type(field.default), default=None, help=help_text)


def _seconds_or_auto(text: str) -> float | str:
    return text if text == "auto" else float(text)


def daso_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--daso-*`` flags that were given, as DasoConfig fields."""
    return {
        field.name: getattr(args, "daso_" + field.name)
        for field in dataclasses.fields(DasoConfig)
        if getattr(args, "daso_" + field.name) is not None
    }


def strategy_from_args(args: argparse.Namespace) -> HorovodStrategy:
    """Build the strategy from the flags; DASO flags without ``--sync daso`` are an error."""
    daso = daso_settings(args)
    if daso and args.sync != "daso":
        flags = ", ".join("--daso-" + name.replace("_", "-") for name in daso)
        raise ValueError(f"{flags} given with --sync {args.sync}; DASO settings need --sync daso")
    return HorovodStrategy(
        compression=args.compression,
        op=args.op,
        gradient_predivide_factor=args.gradient_predivide_factor,
        scale_lr=args.scale_lr,
        sync=args.sync,
        hierarchical_impl=args.hierarchical_impl,
        compress_node_local=args.compress_node_local,
        daso=daso if args.sync == "daso" else None,
        sync_batchnorm=args.sync_batchnorm,
        average_buffers=not args.no_average_buffers,
        bucket_mb=args.bucket_mb,
        stall_timeout_seconds=args.stall_timeout,
        check_finite_gradients=args.check_finite_gradients,
    )


def monitor_callbacks(args: argparse.Namespace) -> list[Callback]:
    """The callbacks asked for with ``--monitor`` and ``--timeline-steps``, and DASO's schedule log."""
    from hvd_plugins.pytorch.callbacks import CommunicationMonitor, DasoScheduleCallback, HorovodTimeline, PeakMemoryMonitor

    callbacks: list[Callback] = [DasoScheduleCallback()] if args.sync == "daso" else []
    if args.monitor:
        callbacks += [PeakMemoryMonitor(), CommunicationMonitor()]
    if args.timeline_steps is not None:
        start, stop = args.timeline_steps
        callbacks.append(HorovodTimeline(args.out_dir / "timeline.json", start_step=start, stop_step=stop))
    return callbacks


def build_trainer(args: argparse.Namespace, callbacks: list[Callback] | None = None) -> Trainer:
    """A CPU/GPU Trainer on HorovodStrategy that logs per epoch to ``<out-dir>/logs/metrics.csv``."""
    if args.accumulate < 1:
        raise ValueError(f"--accumulate {args.accumulate} must be >= 1")
    if args.epochs < 1:
        raise ValueError(f"--epochs {args.epochs} must be >= 1")
    return Trainer(
        strategy=strategy_from_args(args),
        accelerator="auto",
        devices="auto",
        max_epochs=args.epochs,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        logger=CSVLogger(args.out_dir, name="", version="logs"),
        callbacks=[*(callbacks or []), *monitor_callbacks(args)],
        enable_progress_bar=not args.no_progress_bar,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )


# ---------------------------------------------------------------------- results
def epoch_metrics(csv_path: Path) -> dict[str, dict[int, float]]:
    """Read a CSVLogger file into ``{metric: {epoch: last value logged in that epoch}}``."""
    table: dict[str, dict[int, float]] = defaultdict(dict)
    with open(csv_path, newline="") as file:
        for row in csv.DictReader(file):
            if not row.get("epoch"):
                continue
            epoch = int(float(row["epoch"]))
            for name, value in row.items():
                if name in ("epoch", "step") or value in ("", None):
                    continue
                table[name][epoch] = float(value)
    return dict(table)


def plot_run(csv_path: Path, png_path: Path, title: str, panels: dict[str, list[str]]) -> Path:
    """Plot per-epoch curves; ``panels`` maps a panel title to the metric names drawn in it.

    A DASO panel (every logged metric whose name starts with ``daso``) is added when present.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = epoch_metrics(csv_path)
    wanted = {name: [m for m in names if m in table] for name, names in panels.items()}
    daso = sorted(name for name in table if name.startswith("daso"))
    if daso:
        wanted["DASO schedule"] = daso
    wanted = {name: metrics for name, metrics in wanted.items() if metrics}
    figure, axes = plt.subplots(1, max(1, len(wanted)), figsize=(4.5 * max(1, len(wanted)), 3.6), squeeze=False)
    for axis, (panel, metrics) in zip(axes[0], wanted.items(), strict=False):
        for metric in metrics:
            epochs = sorted(table[metric])
            drawstyle = "steps-post" if panel == "DASO schedule" else "default"
            axis.plot(epochs, [table[metric][e] for e in epochs], marker="o", ms=3, label=metric, drawstyle=drawstyle)
        axis.set_title(panel)
        axis.set_xlabel("epoch")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return png_path


def describe_run(args: argparse.Namespace, world_size: int) -> str:
    """One line naming the settings that matter, for the plot title and the log."""
    parts = [f"{world_size} worker(s)", f"compression={args.compression}", f"sync={args.sync}"]
    if args.accumulate > 1:
        parts.append(f"accumulate={args.accumulate}")
    if args.precision != "32-true":
        parts.append(f"precision={args.precision}")
    return ", ".join(parts)
