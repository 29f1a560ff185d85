"""Fabric's launcher for ``HorovodRayStrategy``: the function ``fabric.launch`` was given runs in Ray actors, and
rank 0's return value comes back to the driver (as Lightning's spawn launcher returns rank 0's)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from hvd_plugins.core.backend.ray_workers import RayWorkers, RayWorkerSpec
from hvd_plugins.fabric.lightning_internals import FabricLauncher


def to_cpu(value: Any) -> Any:
    """Tensors (also inside lists, tuples and dicts) moved to the CPU, for the trip to the driver."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(item) for item in value)
    return value


def rank_zero_result(function: Callable, args: tuple, kwargs: dict) -> Any:
    """In each actor: ``function``'s result on rank 0 (on the CPU), None elsewhere."""
    result = function(*args, **kwargs)
    return to_cpu(result) if os.environ.get("HOROVOD_RANK") == "0" else None


class RayFabricLauncher(FabricLauncher):
    """Starts ``spec.num_workers`` Horovod workers as Ray actors for each launch, and stops them when it ends."""

    def __init__(self, spec: RayWorkerSpec) -> None:
        self.spec = spec
        self._workers: RayWorkers | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Travels to the workers with the strategy: without the driver's actors and rendezvous."""
        return {**self.__dict__, "_workers": None}

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True  # the workers are other processes; the driver only waits

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return self._run_on_workers(lambda: rank_zero_result(function, args, kwargs))[0]

    def _run_on_workers(self, payload: Callable[[], Any]) -> list[Any]:
        """``payload()`` in every worker, by rank; the workers stopped after, whatever happened."""
        workers = RayWorkers(self.spec)
        self._workers = workers
        try:
            workers.start()
            return workers.run(payload)
        finally:
            workers.shutdown()
            self._workers = None

    def kill(self, signum: int) -> None:
        if self._workers is not None:
            self._workers.shutdown()
