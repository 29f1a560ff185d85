"""Lightning's launcher for ``python train.py`` with ``devices=N``: start the workers once, then Horovod.

The workers themselves are started by ``hvd_plugins.core.backend.runner`` (Horovod's own runner,
as ``horovodrun -np N -H localhost:N --gloo`` does); Fabric's launcher does the starting, this class
adds what the Trainer asks of a launcher besides (its ``trainer`` argument, ``kill``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hvd_plugins.core.backend.runner import kill_local_job
from hvd_plugins.fabric.lightning_internals import TrainerLauncher
from hvd_plugins.fabric.strategies.launchers.horovod import HorovodFabricLauncher

if TYPE_CHECKING:
    import lightning.pytorch as pl


class HorovodScriptLauncher(HorovodFabricLauncher, TrainerLauncher):
    """Starts the workers (once per process) and Horovod, then runs Lightning's fit/validate/test/predict."""

    asked_as = "Trainer"

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        return super().launch(function, *args, **kwargs)

    @override
    def kill(self, signum: int) -> None:
        kill_local_job(signum)
