"""Waiting for Horovod collectives without keeping a core busy."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.optim import Optimizer

from hvd_plugins.core.backend.build_marker import applied_patches
from hvd_plugins.core.backend.module import horovod_torch

POLL_START_S = 20e-6
POLL_MAX_S = 1e-3
"""A waiting worker sleeps between polls, from 20 us doubling up to Horovod's 1 ms cycle."""
SLEEPING_WAIT_PATCH = "0008-sleeping-synchronize-wait"
"""The patch of ``hvd-build-horovod``'s build with which ``hvd.synchronize`` sleeps until done itself."""


def synchronize_sleeps(marker: Path | None = None) -> bool:
    """Whether Horovod's own wait sleeps (the build applied ``SLEEPING_WAIT_PATCH``; another build's
    wait spins): then polling first would only add up to one poll interval. ``marker``: the build
    marker to read (default: the installed Horovod's, see ``build_marker``)."""
    return SLEEPING_WAIT_PATCH in applied_patches(marker)


def wait_for(handle: Any) -> Any:
    """``hvd.synchronize(handle)`` without keeping a core busy while the collective is in flight.

    A stock Horovod's wait spins (``WaitAndClear`` loops on ``std::this_thread::yield``), so on a
    host with more workers than cores the workers that wait take the CPU from those still computing
    and from Horovod's background threads, and every collective waits for the slowest of them.
    There, polling with short sleeps hands the core back; it adds at most one poll interval. The
    wheel ``hvd-build-horovod`` builds waits on a condition variable, and is called directly.
    """
    hvd = horovod_torch()
    if not synchronize_sleeps():
        _sleep_until(lambda: hvd.poll(handle))
    return hvd.synchronize(handle)


def wait_for_pending_allreduces(optimizer: Optimizer) -> None:
    """Let a DistributedOptimizer's allreduces in flight finish (as ``wait_for`` does) before it synchronizes."""
    if synchronize_sleeps():
        return
    hvd = horovod_torch()
    # A sparse gradient's "handle" is a function Horovod's synchronize calls (two allgathers inside):
    # it cannot be polled, and that synchronize waits for it.
    handles = [handle for handle, _ in getattr(optimizer, "_handles", {}).values() if isinstance(handle, int)]
    _sleep_until(lambda: all(hvd.poll(handle) for handle in handles))


def _sleep_until(done: Callable[[], bool]) -> None:
    pause = POLL_START_S
    while not done():
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
