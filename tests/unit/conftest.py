"""The unit tier's stand-in for a running Horovod: one rank of a pretend job, in the pytest process.

A real ``hvd.init()`` here would start Horovod (and MPI) for the rest of the session, which the
tests of plain processes must not see; the core reaches Horovod through ``horovod_torch()`` in
each module, so a test hands those modules a ``FakeHorovod`` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch


class FakeDistributedOptimizer:
    """What the core touches of Horovod's ``DistributedOptimizer``: its countdowns, handles and hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, **horovod_arguments: Any) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.horovod_arguments = horovod_arguments
        self.backward_passes_per_step = horovod_arguments.get("backward_passes_per_step", 1)
        trainable = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._allreduce_delay = dict.fromkeys(trainable, self.backward_passes_per_step)
        self._handles: dict[torch.nn.Parameter, tuple[object | None, object]] = {}
        self._grad_accs: list[object] = [object() for _ in trainable]
        self.events: list[str] = []
        self.skipping = False

    def synchronize(self) -> None:
        self.events.append("synchronize")

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        self.skipping = True
        try:
            yield
        finally:
            self.skipping = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._allreduce_delay = dict.fromkeys(self._allreduce_delay, passes)

    def start_allreduces(self) -> None:
        """As if a backward's hooks had started an allreduce for every parameter."""
        self._handles = {parameter: (object(), None) for parameter in self._allreduce_delay}


class FakeHorovod:
    """``horovod.torch`` as one rank of a job of ``size`` workers sees it.

    An allreduce adds ``others(tensor, name)`` (what the other ranks contribute; zeros by default)
    to this rank's tensor; every collective is recorded in ``calls``.
    """

    Average, Sum, Adasum, Max, Min = "Average", "Sum", "Adasum", "Max", "Min"

    def __init__(
        self,
        size: int = 1,
        rank: int = 0,
        cross_size: int = 1,
        others: Callable[[torch.Tensor, str | None], torch.Tensor] | None = None,
        last_joined: int = 0,
    ) -> None:
        self._size, self._rank, self._cross_size = size, rank, cross_size
        self.others = others
        self.last_joined = last_joined
        self.calls: list[tuple[Any, ...]] = []

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def cross_size(self) -> int:
        return self._cross_size

    def is_initialized(self) -> bool:
        return True

    def allreduce(self, tensor: torch.Tensor, op: str | None = None, name: str | None = None) -> torch.Tensor:
        self.calls.append(("allreduce", name, op))
        total = tensor + (self.others(tensor, name) if self.others is not None else torch.zeros_like(tensor))
        return total / self._size if op in (None, self.Average) else total

    def join(self) -> int:
        self.calls.append(("join",))
        return self.last_joined

    def broadcast_parameters(self, state: dict[str, torch.Tensor], root_rank: int) -> None:
        self.calls.append(("broadcast_parameters", root_rank))

    def DistributedOptimizer(self, optimizer: torch.optim.Optimizer, **arguments: Any) -> FakeDistributedOptimizer:
        self.calls.append(("DistributedOptimizer",))
        return FakeDistributedOptimizer(optimizer, **arguments)


@pytest.fixture
def fake_horovod(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeHorovod]:
    """``fake_horovod(module, ..., size=2, rank=1)``: those modules' ``horovod_torch()`` returns one FakeHorovod."""

    def install(*modules: ModuleType, **settings: Any) -> FakeHorovod:
        hvd = FakeHorovod(**settings)
        for module in modules:
            monkeypatch.setattr(module, "horovod_torch", lambda: hvd)
        return hvd

    return install
