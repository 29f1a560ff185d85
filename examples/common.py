"""Plumbing shared by the examples: flags -> HorovodStrategy, logging, plots.

Kept apart so each example script reads top to bottom as data, model, Trainer, result.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import inspect
import re
import textwrap
import types
import typing
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from hvd_plugins import DasoConfig
from hvd_plugins.pytorch import HorovodStrategy

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")

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
        "--sync-batchnorm", action="store_true", help="BatchNorm statistics over all workers (HorovodSyncBatchNorm)"
    )
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


STRATEGY_FLAGS_SKIPPED = frozenset({"daso", "accelerator", "parallel_devices", "checkpoint_io", "precision_plugin"})
"""HorovodStrategy arguments that get no flag: DASO's come one per field, the rest is the Trainer's business."""


def strategy_flag_arguments() -> list[inspect.Parameter]:
    """HorovodStrategy's arguments that have a flag of their own, in signature order."""
    parameters = inspect.signature(HorovodStrategy.__init__).parameters.values()
    return [p for p in parameters if p.name != "self" and p.name not in STRATEGY_FLAGS_SKIPPED]


def add_strategy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per HorovodStrategy argument and per DasoConfig field (``--daso-<field>``), read from their code.

    Names, choices, defaults and help come from the signature, its ``Literal`` types and the docstrings,
    so the flags cannot drift from the strategy: ``--compression fp16``, ``--sync daso``, ``--no-average-buffers``.
    """
    group = parser.add_argument_group("HorovodStrategy")
    helps = _docstring_args(HorovodStrategy.__doc__ or "")
    hints = typing.get_type_hints(HorovodStrategy.__init__)
    for parameter in strategy_flag_arguments():
        name = parameter.name
        _add_flag(group, name, hints[name], parameter.default, helps.get(name, ""), dest=name)
    daso = parser.add_argument_group("DASO (only with --sync daso; defaults from DasoConfig)")
    daso_helps = _attribute_docstrings(DasoConfig)
    daso_hints = typing.get_type_hints(DasoConfig)
    for field in dataclasses.fields(DasoConfig):
        _add_flag(daso, f"daso_{field.name}", daso_hints[field.name], None, daso_helps.get(field.name, ""))


def _add_flag(group: Any, name: str, hint: Any, default: Any, help_text: str, dest: str | None = None) -> None:
    """``--name``: a switch for booleans (``--no-name`` when on by default), else a typed value."""
    flag = "--" + name.replace("_", "-")
    help_text = f"{help_text} (default {default})" if default is not None else help_text
    if hint is bool:
        if default is True:
            group.add_argument("--no-" + flag[2:], dest=dest or name, action="store_false", help=help_text)
        else:
            group.add_argument(flag, dest=dest or name, action="store_true", default=default, help=help_text)
        return
    choices = [value for option in _options(hint) if typing.get_origin(option) is Literal for value in option.__args__]
    numbers = [option for option in _options(hint) if option in (int, float)]
    if choices and not numbers:
        group.add_argument(flag, dest=dest or name, choices=choices, default=default, help=help_text)
    else:
        group.add_argument(flag, dest=dest or name, type=_parse_as(numbers, choices), default=default, help=help_text)


def _options(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _parse_as(numbers: list[type], words: list[str]) -> Any:
    def parse(text: str) -> Any:
        if text in words:
            return text
        return numbers[0](text) if numbers else text

    parse.__name__ = "/".join([*words, *(n.__name__ for n in numbers)]) or "value"
    return parse


def _docstring_args(doc: str) -> dict[str, str]:
    """``name: help`` of a Google-style ``Args:`` section (first sentence)."""
    section = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    entries = re.findall(r"^\s{8}(\w+): (.+?)(?=^\s{8}\w+: |\n\s*\n|\Z)", section, flags=re.M | re.S)
    return {name: " ".join(text.split()).split(". ")[0] for name, text in entries}


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of a dataclass (first sentence)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    found: dict[str, str] = {}
    statements = getattr(body, "body", [])
    for assignment, following in zip(statements, statements[1:], strict=False):
        if isinstance(assignment, ast.AnnAssign) and isinstance(following, ast.Expr):
            text = following.value.value if isinstance(following.value, ast.Constant) else ""
            found[ast.unparse(assignment.target)] = " ".join(str(text).split()).split(". ")[0]
    return found


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
    settings = {parameter.name: getattr(args, parameter.name) for parameter in strategy_flag_arguments()}
    return HorovodStrategy(**settings, daso=daso if args.sync == "daso" else None)


def monitor_callbacks(args: argparse.Namespace) -> list[Callback]:
    """The callbacks asked for with ``--monitor`` and ``--timeline-steps``, and DASO's schedule log."""
    from hvd_plugins.pytorch.callbacks import (
        CommunicationMonitor,
        DasoScheduleCallback,
        HorovodTimeline,
        PeakMemoryMonitor,
    )

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
        sync_batchnorm=args.sync_batchnorm,
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
