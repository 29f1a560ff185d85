"""The step between backward and the optimizer: average the gradients, bounded and checked.

A strategy runs backward (inside Lightning's closure, or in ``fabric.backward``) and then calls
``after_backward``: the gradient sync averages, the watchdog bounds the wait, and the finite check
stops every rank at once at the first NaN/Inf. Waits of the strategy's own collectives (barriers)
go through ``waiting`` so the same bound holds there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

from torch.optim import Optimizer

from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.faults.finite import FiniteGradientCheck, require_no_grad_scaler
from hvd_plugins.core.faults.watchdog import CollectiveWatchdog
from hvd_plugins.core.sync.base import GradientSync


class SyncGuards:
    """The guards around every gradient sync: the stall watchdog and the NaN/Inf check.

    Owns the watchdog (one per process, from the first setup on) and the finite check of the running
    fit; it averages nothing itself, the gradient sync it is handed does.
    """

    def __init__(self, config: HorovodConfig) -> None:
        self.config = config
        self.watchdog: CollectiveWatchdog | None = None
        self.finite_check: FiniteGradientCheck | None = None
        self._averaged: set[int] = set()  # optimizers averaged since the last backward began (by id)

    def start_watching(self, rank: int, size: int) -> None:
        """Start the watchdog once Horovod runs (``stall_timeout_seconds=None``: never)."""
        if self.config.stall_timeout_seconds is not None and self.watchdog is None:
            self.watchdog = CollectiveWatchdog(self.config.stall_timeout_seconds, rank, size)

    def follow_world(self, rank: int, size: int) -> None:
        """After an elastic reset: the watchdog names the new rank and size in its report."""
        if self.watchdog is not None:
            self.watchdog.follow_world(rank, size)

    def waiting(self, what: str) -> AbstractContextManager[None]:
        """Bound a wait with ``stall_timeout_seconds`` when it is set."""
        return self.watchdog.waiting(what) if self.watchdog is not None else nullcontext()

    def check_gradients_of(self, optimizers: Sequence[Optimizer], precision_plugin: object) -> None:
        """With ``check_finite_gradients``, watch the gradients of these (wrapped) optimizers (no GradScaler)."""
        self.stop_checking()
        if self.config.check_finite_gradients:
            require_no_grad_scaler(precision_plugin)
            self.finite_check = FiniteGradientCheck(optimizers)

    def after_backward(self, sync: GradientSync, optimizer: Optimizer, where: Callable[[], str]) -> None:
        """Average ``optimizer``'s gradients now (collective), before clipping and AMP unscaling see them; once per
        backward (manual optimization averages as its backward ends, and the step finds it done).

        ``where()`` names the training position for the finite check's error; it is asked only then.
        """
        if id(optimizer) in self._averaged:
            return
        self._averaged.add(id(optimizer))
        with self.waiting("gradient allreduce"):
            sync.synchronize(optimizer)
            if self.finite_check is not None:
                self.finite_check.after_average(optimizer, sync.owned_gradients(optimizer), where())

    def average_for_step(self, sync: GradientSync, optimizer: Optimizer, where: Callable[[], str]) -> None:
        """Before a step: ``after_backward``, unless this backward's average already ran; either way the next
        backward's gradients are averaged anew (a loop may call ``loss.backward()`` itself, past the strategy)."""
        self.after_backward(sync, optimizer, where)
        self._averaged.discard(id(optimizer))

    def new_backward(self) -> None:
        """A backward begins: the gradients it adds are averaged anew."""
        self._averaged.clear()

    def stop_checking(self) -> None:
        if self.finite_check is not None:
            self.finite_check.remove()
            self.finite_check = None
