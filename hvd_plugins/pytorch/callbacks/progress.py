"""A progress display made of whole lines, for launchers and log files, and when it replaces Lightning's bar.

horovodrun prefixes every line a worker writes with ``[rank]<stdout>:``; a bar that redraws itself
with carriage returns becomes a few huge lines there, and in a log file. This one prints whole
lines from rank 0 only: one per epoch and per evaluation run, and at most one every
``refresh_seconds`` in between. Under a launcher (or with stdout not a terminal) the strategy puts it in
place of Lightning's default ``TQDMProgressBar`` (``use_line_progress_bar``).
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from hvd_plugins.core.backend.launch_env import launched_by_launcher
from hvd_plugins.pytorch.loop_events import batch_loss
from hvd_plugins.pytorch.utilities.callbacks import trainer_callbacks

HIDDEN_METRICS = frozenset({"v_num"})
"""Progress-bar items that say nothing about training (the logger's version)."""


@dataclass
class _Span:
    """Batches, time and loss of one stretch of a loop: an epoch, an evaluation, the time since the last line."""

    start: float = field(default_factory=time.monotonic)
    last: float = 0.0
    batches: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0

    def add(self, loss: float | None = None) -> None:
        self.batches += 1
        self.last = time.monotonic()
        if loss is not None and math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1

    @property
    def seconds(self) -> float:
        return max(self.last - self.start, 0.0)

    @property
    def rate(self) -> str:
        return f"{self.batches / self.seconds:.1f} it/s" if self.seconds > 0 else "- it/s"

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.loss_count if self.loss_count else None


def format_value(value: Any) -> str:
    """Four significant digits for floats (and one-element tensors); anything else as it prints."""
    if hasattr(value, "numel") and value.numel() == 1:
        value = value.item()
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _of(done: int, total: int | float | None) -> str:
    """``done/total``, or just ``done`` when the total is unknown or infinite."""
    return f"{done}/{int(total)}" if total is not None and math.isfinite(total) and total > 0 else str(done)


def _total(batches: int | float | list[int | float]) -> int | float:
    return sum(batches) if isinstance(batches, list) else batches


class LineProgressBar(ProgressBar):
    """Progress as whole lines on rank 0, e.g. ``epoch 3/15 | batch 12/23 | 7.4 it/s | loss 0.412``.

    Args:
        refresh_seconds: least time between two lines inside an epoch or an evaluation; the line
            at the end of each epoch and each evaluation is printed regardless.
        stream: where lines go; ``None`` means ``sys.stdout`` at the time of printing.

    ``loss`` is the mean training-step loss of rank 0's own batches since the previous line (a
    progress bar runs on rank 0 only, so it does not average over workers). Logged metrics are the
    ones logged with ``prog_bar=True``, as in Lightning's own bar. Validation that runs at an epoch's
    end shows in that epoch's line; validation inside an epoch gets a line of its own.
    """

    def __init__(self, refresh_seconds: float = 10.0, stream: TextIO | None = None) -> None:
        super().__init__()
        if not refresh_seconds > 0:
            raise ValueError(f"LineProgressBar(refresh_seconds={refresh_seconds}) must be > 0")
        self.refresh_seconds = refresh_seconds
        self.stream = stream
        self._enabled = True
        self._last_line = time.monotonic()
        self._epoch = _Span()
        self._since_line = _Span()
        self._evaluation = _Span()

    # ------------------------------------------------------------------ ProgressBar interface
    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def print(self, *args: Any, **kwargs: Any) -> None:
        """What ``LightningModule.print`` shows, written like the progress lines."""
        if self._enabled:
            sep, end = kwargs.get("sep", " "), kwargs.get("end", "\n")
            text = (" " if sep is None else sep).join(map(str, args)) + ("\n" if end is None else end)
            _write_whole(kwargs.get("file") or self._stream(), text)

    # ------------------------------------------------------------------ lines
    def _stream(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stdout

    def _write(self, line: str) -> None:
        if self._enabled:
            _write_whole(self._stream(), line + "\n")
            self._last_line = time.monotonic()

    def _due(self) -> bool:
        return self._enabled and time.monotonic() - self._last_line >= self.refresh_seconds

    def _metrics(self, trainer: Trainer, pl_module: LightningModule) -> list[str]:
        items = self.get_metrics(trainer, pl_module)
        return [f"{name} {format_value(value)}" for name, value in items.items() if name not in HIDDEN_METRICS]

    @staticmethod
    def _epoch_text(trainer: Trainer) -> str:
        """1-based, so the last epoch of 15 reads ``epoch 15/15``."""
        limit = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        return f"epoch {_of(trainer.current_epoch + 1, limit)}"

    @staticmethod
    def _fitting(trainer: Trainer) -> bool:
        """Inside ``fit`` (``trainer.training`` is false while fit validates)."""
        return trainer.state.fn == TrainerFn.FITTING

    @staticmethod
    def _loss_text(span: _Span) -> list[str]:
        return [] if span.loss is None else [f"loss {span.loss:.4g}"]

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        limit = f"{trainer.max_epochs} epochs" if trainer.max_epochs and trainer.max_epochs > 0 else "no epoch limit"
        batches = self.total_train_batches
        per_epoch = f"{int(batches)} batches" if math.isfinite(batches) else "unknown number of batches"
        self._write(f"training | {trainer.world_size} worker(s) | {limit} | {per_epoch} per epoch and worker")

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch, self._since_line = _Span(), _Span()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = batch_loss(outputs, trainer, pl_module)
        self._epoch.add(loss)
        self._since_line.add(loss)
        if self._due() and self._epoch.batches < self.total_train_batches:  # the epoch's end prints its own
            fields = [
                self._epoch_text(trainer),
                f"batch {_of(self._epoch.batches, self.total_train_batches)}",
                self._since_line.rate,
                *self._loss_text(self._since_line),
            ]
            self._write(" | ".join(fields + self._metrics(trainer, pl_module)))
            self._since_line = _Span()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fields = [
            self._epoch_text(trainer),
            f"{self._epoch.batches} batches in {self._epoch.seconds:.1f} s",
            self._epoch.rate,
            *self._loss_text(self._epoch),
        ]
        self._write(" | ".join(fields + self._metrics(trainer, pl_module)))

    # ------------------------------------------------------------------ evaluation
    def _start_evaluation(self, trainer: Trainer) -> None:
        self._evaluation = _Span()
        if not self._fitting(trainer):  # the first line of a lone evaluation comes after refresh_seconds too
            self._last_line = self._evaluation.start

    def _evaluation_batch(self, trainer: Trainer, pl_module: LightningModule, name: str, total: float) -> None:
        self._evaluation.add()
        if self._due() and self._evaluation.batches < total:
            prefix = [self._epoch_text(trainer)] if self._fitting(trainer) else []
            fields = [*prefix, f"{name} batch {_of(self._evaluation.batches, total)}", self._evaluation.rate]
            self._write(" | ".join(fields))

    def _evaluation_end(self, trainer: Trainer, pl_module: LightningModule, name: str, metrics: bool = True) -> None:
        fitting = self._fitting(trainer)
        prefix = [self._epoch_text(trainer), f"{name} after batch {self._epoch.batches}"] if fitting else [name]
        fields = [*prefix, f"{self._evaluation.batches} batches in {self._evaluation.seconds:.1f} s"]
        self._write(" | ".join(fields + (self._metrics(trainer, pl_module) if metrics else [])))

    def _within_epoch(self, trainer: Trainer) -> bool:
        """Whether a validation during fit came before the epoch's last batch (so no epoch line follows it soon)."""
        return self._epoch.batches < self.total_train_batches

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_evaluation(trainer)

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self._evaluation_batch(trainer, pl_module, "validation", _total(trainer.num_val_batches))

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self._fitting(trainer):
            if not self._within_epoch(trainer):
                return  # the epoch's line follows and carries the validation metrics
            paused = time.monotonic() - self._evaluation.start  # training rates leave validation out
            self._epoch.start += paused
            self._since_line.start += paused
        self._evaluation_end(trainer, pl_module, "validation")

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_evaluation(trainer)

    @override
    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._evaluation_batch(trainer, pl_module, "test", _total(trainer.num_test_batches))

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_end(trainer, pl_module, "test")

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_evaluation(trainer)

    @override
    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._evaluation_batch(trainer, pl_module, "prediction", _total(trainer.num_predict_batches))

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_end(trainer, pl_module, "prediction", metrics=False)


# ---------------------------------------------------------------------------- the default bar under a launcher
def _given_callbacks(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    return [callbacks] if isinstance(callbacks, Callback) else list(callbacks)


def progress_bar_given_to_trainer() -> bool | None:
    """Whether the ``Trainer`` being built was given a progress bar in ``callbacks``.

    Called from a strategy hook that runs inside ``Trainer.__init__`` (``set_world_ranks``), before
    Lightning adds its default bar, which is otherwise indistinguishable from a ``TQDMProgressBar()``
    the user passed. None when no ``Trainer.__init__`` is on the call stack.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), Trainer):
                return any(isinstance(c, ProgressBar) for c in _given_callbacks(frame.f_locals.get("callbacks")))
            frame = frame.f_back
        return None
    finally:
        del frame  # frames hold their locals: do not keep the Trainer's alive


def tqdm_reads_badly(world_size: int) -> bool:
    """Under a launcher, or with stdout piped to a file: carriage returns do not redraw there."""
    return world_size > 1 or launched_by_launcher() or not sys.stdout.isatty()


def use_line_progress_bar(trainer: Trainer, bar_given: bool | None, world_size: int) -> bool:
    """Swap Lightning's default ``TQDMProgressBar`` for a ``LineProgressBar`` where tqdm reads badly.

    A bar the user passed (``bar_given``; None means unknown) is never replaced, nor a subclass of
    tqdm's; ``enable_progress_bar=False`` leaves no bar to replace. Returns whether it swapped.
    """
    bar = trainer.progress_bar_callback
    if bar_given is not False or type(bar) is not TQDMProgressBar or not tqdm_reads_badly(world_size):
        return False
    callbacks = trainer_callbacks(trainer)
    callbacks[callbacks.index(bar)] = LineProgressBar()
    return True


def _write_whole(stream: TextIO, text: str) -> None:
    """``text`` in one write, then flushed: ``print`` writes the line and its newline apart, and on an
    unbuffered stream OpenMPI's per-rank output tagging (``horovodrun --mpi``) cut the line in two."""
    stream.write(text)
    stream.flush()
