"""Fabric's launcher for ``HorovodRayStrategy``: the function ``fabric.launch`` was given runs in Ray actors, and
rank 0's return value comes back to the driver (as Lightning's spawn launcher returns rank 0's)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from hvd_plugins.core.backend.ray_elastic import ElasticRayWorkers
from hvd_plugins.core.backend.ray_spec import RayWorkerSpec
from hvd_plugins.core.backend.ray_workers import RayWorkers, WorkerGroup, current_rank
from hvd_plugins.fabric.lightning_internals import FabricLauncher


def to_cpu(value: Any) -> Any:
    """Tensors (inside any collection Lightning knows: namedtuples, ordered dicts...) on the CPU, detached, for
    the trip to the driver."""
    return move_data_to_device(apply_to_collection(value, torch.Tensor, torch.Tensor.detach), "cpu")


def rank_zero_result(follow_rank: Callable[[int], None], function: Callable, args: tuple, kwargs: dict) -> Any:
    """In each actor: rank-zero output on this rank from the start, then ``function``; its result on rank 0 (on
    the CPU), None elsewhere."""
    follow_rank(current_rank())
    result = function(*args, **kwargs)
    return to_cpu(result) if current_rank() == 0 else None


def launches_nothing(function: Callable) -> bool:
    """``fabric.launch()`` with no function: Fabric then wraps a function that does nothing."""
    inner = function.args[0] if isinstance(function, partial) and function.args else function
    return getattr(inner, "__name__", "") == "_do_nothing"


class RayFabricLauncher(FabricLauncher):
    """Starts ``spec.num_workers`` Horovod workers as Ray actors for each launch, and stops them when it ends."""

    def __init__(self, spec: RayWorkerSpec, follow_rank: Callable[[int], None]) -> None:
        self.spec = spec
        self.follow_rank = follow_rank  # the strategy's: rank-zero output on the actor's rank
        self._workers: WorkerGroup | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Travels to the workers with the strategy: without the driver's actors and rendezvous."""
        return {**self.__dict__, "_workers": None}

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True  # the workers are other processes; the driver only waits

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        if launches_nothing(function):
            raise TypeError(
                "HorovodRayStrategy runs the workers as Ray actors: give fabric.launch the function they run, "
                "fabric.launch(train), which returns rank 0's result here"
            )
        follow_rank = self.follow_rank
        return self._run_on_workers(lambda: rank_zero_result(follow_rank, function, args, kwargs))[0]

    def _run_on_workers(self, payload: Callable[[], Any]) -> list[Any]:
        """``payload()`` in every worker, by rank; the workers stopped after, whatever happened."""
        workers: RayWorkers | ElasticRayWorkers = (
            RayWorkers(self.spec) if self.spec.elastic is None else ElasticRayWorkers(self.spec)
        )
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
