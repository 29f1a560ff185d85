"""Lightning's launcher for ``python train.py`` with ``devices=N``: start the workers once, then Horovod.

The workers themselves are started by ``hvd_plugins.core.backend.runner`` (Horovod's own runner,
as ``horovodrun -np N -H localhost:N --gloo`` does); this class only fits that into Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers.launcher import _Launcher
from typing_extensions import override

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.runner import LocalJob

if TYPE_CHECKING:
    import lightning.pytorch as pl

_job: LocalJob | None = None
"""The one job this process started; it outlives Trainers (a later Trainer sees the Horovod variables)."""


class HorovodScriptLauncher(_Launcher):
    """Starts the workers (once per process) and Horovod, then runs Lightning's fit/validate/test/predict."""

    def __init__(self, size: int, start_horovod: Callable[[], Any]) -> None:
        self.size = size
        self._start_horovod = start_horovod

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False  # the workers re-run the script, which a notebook does not have

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        global _job
        if _job is None:
            if horovod_torch().is_initialized():
                raise RuntimeError(
                    f"hvd.init() ran before the {self.size} workers of Trainer(devices={self.size}) were started. "
                    "Let the strategy start Horovod, or launch with `horovodrun`."
                )
            _job = LocalJob(self.size)
            _job.wait_for_workers()
        self._start_horovod()
        return function(*args, **kwargs)

    @override
    def kill(self, signum: int) -> None:
        if _job is not None:
            _job.kill(signum)
