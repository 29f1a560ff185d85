"""Lightning's launcher for ``python train.py`` with ``devices=N``: start the workers once, then Horovod.

The workers themselves are started by ``hvd_plugins.core.backend.runner`` (Horovod's own runner,
as ``horovodrun -np N -H localhost:N --gloo`` does); this class only fits that into Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers.launcher import _Launcher
from typing_extensions import override

from hvd_plugins.core.backend.runner import kill_local_job, start_local_job_once

if TYPE_CHECKING:
    import lightning.pytorch as pl


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
        start_local_job_once(self.size, self._start_horovod, f"Trainer(devices={self.size})")
        return function(*args, **kwargs)

    @override
    def kill(self, signum: int) -> None:
        kill_local_job(signum)
