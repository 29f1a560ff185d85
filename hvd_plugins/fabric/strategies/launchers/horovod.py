"""Fabric's launcher for ``python train.py`` with ``Fabric(devices=N)``: start the workers once, then Horovod.

The workers are started by ``hvd_plugins.core.backend.runner``, as for the Trainer's launcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from typing_extensions import override

from hvd_plugins.core.backend.runner import start_local_job_once
from hvd_plugins.fabric.lightning_internals import FabricLauncher


class HorovodFabricLauncher(FabricLauncher):
    """Starts the workers (once per process) and Horovod, then runs the function ``fabric.launch`` was given."""

    asked_as = "Fabric"  # in the message when Horovod was started too early

    def __init__(self, size: int, start_horovod: Callable[[], Any]) -> None:
        self.size = size
        self._start_horovod = start_horovod

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False  # the workers re-run the script, which a notebook does not have

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        start_local_job_once(self.size, self._start_horovod, f"{self.asked_as}(devices={self.size})")
        return function(*args, **kwargs)
