"""The collectives a Lightning strategy answers with (reduce, all_gather, broadcast, barrier), over Horovod.

Every call is named from ``COLLECTIVE_NAMES`` (equal on every rank), and tensors travel in a dtype
Horovod can reduce (``comm.wire``), coming back in their own.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import Tensor

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.naming import COLLECTIVE_NAMES
from hvd_plugins.core.comm.wire import GATHER, for_wire, from_wire, horovod_op, reduce_op_name

T = TypeVar("T")


def require_whole_world(method: str, group: Any) -> None:
    """Horovod collectives here span every worker: refuse a sub-group by name."""
    if group is not None:
        raise ValueError(f"HorovodStrategy.{method} got group={group!r}; only the whole world (None) is supported")


def reduce_tensor(tensor: Tensor, reduce_op: Any) -> Tensor:
    """``tensor`` reduced over every worker by ``reduce_op`` ("mean", "sum", "max", a ReduceOp...)."""
    op_name = reduce_op_name(reduce_op)
    wire = for_wire(tensor.detach(), op_name)
    result = horovod_torch().allreduce(wire, op=horovod_op(op_name), name=COLLECTIVE_NAMES.next("reduce"))
    return from_wire(result, tensor.dtype, op_name)


def gather_stacked(tensor: Tensor, sync_grads: bool = False) -> Tensor:
    """``tensor`` from every worker, stacked along a new first dimension in rank order."""
    wire = for_wire(tensor if sync_grads else tensor.detach(), GATHER)
    with torch.inference_mode(False):  # Horovod resizes the output on its own thread
        gathered = horovod_torch().allgather(wire.clone().unsqueeze(0), name=COLLECTIVE_NAMES.next("all_gather"))
    return from_wire(gathered, tensor.dtype, GATHER)


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` as rank ``src`` holds it, on every worker (pickled)."""
    return horovod_torch().broadcast_object(obj, root_rank=src, name=COLLECTIVE_NAMES.next("broadcast"))
