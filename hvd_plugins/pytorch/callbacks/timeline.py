"""Record a Horovod timeline for a window of optimizer steps.

Horovod 0.28.1 records a timeline only when ``HOROVOD_TIMELINE`` is set in the environment
before ``hvd.init()``: set to a file name it records the whole run; set to ``DYNAMIC`` it
records nothing until ``hvd.start_timeline(path)`` and stops at ``hvd.stop_timeline()``
(otherwise ``start_timeline`` raises "Set HOROVOD_TIMELINE=DYNAMIC"). Only the coordinator,
rank 0, writes the file; every rank must call start and stop.

The file is Chrome trace JSON (one "process" per tensor, with NEGOTIATE / ALLREDUCE phases):
open it at ``chrome://tracing`` (Load) or https://ui.perfetto.dev (Open trace file).
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from hvd_plugins.core.backend.module import horovod_torch

TIMELINE_ENV = "HOROVOD_TIMELINE"


class HorovodTimeline(Callback):
    """Records Horovod's timeline from optimizer step ``start_step`` up to (not including) ``stop_step``.

    Build it before the Trainer: building the Trainer starts Horovod, and this callback sets
    ``HOROVOD_TIMELINE=DYNAMIC`` (unless already set) so that Horovod starts able to record.

    Args:
        path: file rank 0 writes (Chrome trace JSON); parent folders are created.
        start_step: ``trainer.global_step`` at which recording starts.
        stop_step: ``trainer.global_step`` at which recording stops (after that many steps).
        mark_cycles: also mark Horovod's background-loop cycles in the trace.
    """

    def __init__(
        self, path: str | os.PathLike[str], start_step: int = 0, stop_step: int = 10, mark_cycles: bool = False
    ) -> None:
        if start_step < 0 or stop_step <= start_step:
            raise ValueError(
                f"HorovodTimeline needs 0 <= start_step < stop_step, got start_step={start_step!r}, "
                f"stop_step={stop_step!r}"
            )
        self.path = Path(path)
        self.start_step = int(start_step)
        self.stop_step = int(stop_step)
        self.mark_cycles = bool(mark_cycles)
        self.recording = False
        self._enabled = True
        hvd = horovod_torch()
        if not hvd.is_initialized():
            os.environ.setdefault(TIMELINE_ENV, "DYNAMIC")

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        hvd = horovod_torch()
        if not hvd.is_initialized():
            rank_zero_warn(
                f"HorovodTimeline: Horovod is not running under {type(trainer.strategy).__name__}; "
                "no timeline will be recorded (use hvd_plugins.HorovodStrategy)."
            )
            self._enabled = False
            return
        if hvd.size() == 1:
            rank_zero_warn(
                "HorovodTimeline: a job of one worker runs no Horovod collectives; no timeline will be recorded."
            )
            self._enabled = False
            return
        if TIMELINE_ENV not in os.environ:  # the same environment on every rank: all raise together
            raise RuntimeError(
                "HorovodTimeline: Horovod was started before the callback was built, without "
                f"{TIMELINE_ENV} set, so it cannot record. Build the callback before the Trainer, or "
                f"export {TIMELINE_ENV}=DYNAMIC before launching."
            )
        self._enabled = True

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if self._enabled and not self.recording and self.start_step <= trainer.global_step < self.stop_step:
            self._start(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if self.recording and trainer.global_step >= self.stop_step:
            self._stop(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.recording:
            self._stop(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.recording:
            self._stop(trainer)

    def _start(self, trainer: Trainer) -> None:
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        horovod_torch().start_timeline(str(self.path), mark_cycles=self.mark_cycles)
        self.recording = True

    def _stop(self, trainer: Trainer) -> None:
        horovod_torch().stop_timeline()
        self.recording = False
        last = min(trainer.global_step, self.stop_step) - 1  # stop_step itself is not recorded
        rank_zero_info(
            f"Horovod timeline of steps {self.start_step} to {last} -> {self.path} "
            "(open in chrome://tracing or https://ui.perfetto.dev)"
        )
