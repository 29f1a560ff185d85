"""Averaging a module's floating-point buffers (BatchNorm running statistics) over workers.

Each worker's buffers follow its own batches, so they drift apart even when the parameters are
identical. Averaging is split into start and finish so DASO can overlap it with its parameter
sync. Buffers are flattened into one message per wire dtype: float64 stays float64 (exact),
bfloat16 stays bfloat16 where the installed Horovod takes it (float32's range, half the bytes);
every other floating dtype travels as float32, because a float16 sum of running variances over
many workers can overflow.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.nn import Module

from hvd_plugins.core.backend.bfloat16 import takes_bfloat16
from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.waits import wait_for
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.in_flight import InFlight, Meanwhile
from hvd_plugins.core.comm.layout import flatten, unflatten_into
from hvd_plugins.core.comm.wire import nbytes


def _buffer_wire_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return dtype
    if dtype == torch.bfloat16 and takes_bfloat16(horovod_torch()):
        return dtype
    return torch.float32


class BufferAverage(InFlight[None]):
    """Averages in flight, one Horovod allreduce per wire dtype; ``wait()`` writes them into the buffers."""

    def __init__(self, counters: CommCounters | None = None) -> None:
        self.parts: list[tuple[list[torch.Tensor], Any]] = []
        self.counters = counters

    def progress(self) -> None:
        """One round: nothing to start."""

    def ready(self) -> bool:
        hvd = horovod_torch()
        return all(hvd.poll(handle) for _, handle in self.parts)

    def wait(self, meanwhile: Meanwhile = None) -> None:
        """Wait for the averages and write them into the buffers, in place (cast back to each buffer's dtype)."""
        for buffers, handle in self.parts:
            if meanwhile is not None:
                meanwhile()
            with self.counters.waiting() if self.counters is not None else nullcontext():
                averaged = wait_for(handle)
            with torch.no_grad():
                unflatten_into(averaged, buffers)
        self.parts.clear()


def start_buffer_average(
    module: Module, name: str, counters: CommCounters | None = None, scope: Scope = Scope.NODE_LOCAL
) -> BufferAverage | None:
    """Start averaging ``module``'s floating buffers over all workers; None when there is nothing to do.

    Every rank must call this at the same point with the same module structure and ``name``.
    With ``counters`` the bytes are recorded under ``scope`` and the wait is timed.
    """
    hvd = horovod_torch()
    if hvd.size() == 1:
        return None
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in module.buffers():
        if buffer.is_floating_point():
            by_dtype.setdefault(_buffer_wire_dtype(buffer.dtype), []).append(buffer)
    if not by_dtype:
        return None
    pending = BufferAverage(counters)
    for dtype, buffers in by_dtype.items():
        flat = flatten([buffer.detach().to(dtype) for buffer in buffers])
        if counters is not None:
            counters.record(scope, nbytes(flat))
        handle = hvd.allreduce_async(flat, op=hvd.Average, name=f"{name}.{str(dtype).removeprefix('torch.')}")
        pending.parts.append((buffers, handle))
    return pending


def finish_buffer_average(pending: BufferAverage | None) -> None:
    """Wait for the averages and write them into the buffers (nothing for None: nothing was started)."""
    if pending is not None:
        pending.wait()
