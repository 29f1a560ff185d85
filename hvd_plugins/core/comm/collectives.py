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


def reduce_in_place(tensor: Tensor, reduce_op: Any) -> Tensor:
    """``reduce_tensor``, written into ``tensor`` and returned, as ``torch.distributed.all_reduce`` works in place
    (DDP's ``reduce`` and Fabric's ``all_reduce`` say so). Where the result cannot go back (a mean of integers
    is float64, or ``tensor``'s memory takes no write, as an expanded tensor's) ``tensor`` is left as it was
    and the result is returned on its own."""
    result = reduce_tensor(tensor, reduce_op)
    if result.dtype != tensor.dtype:
        return result
    try:
        with torch.inference_mode() if tensor.is_inference() else torch.no_grad():
            tensor.copy_(result)
    except RuntimeError:  # overlapping memory, or an inference tensor outside inference mode
        return result
    return tensor


def gather_stacked(tensor: Tensor, sync_grads: bool = False) -> Tensor:
    """``tensor`` from every worker, stacked along a new first dimension in rank order.

    With ``sync_grads`` the gather is differentiable the way ``torch.distributed.nn``'s is (what DDP
    uses): the gradient reaching each worker's ``tensor`` is the SUM over workers of the gradients of
    its slice. Horovod's own allgather averages them instead (and fails on a non-contiguous gradient).
    """
    name = COLLECTIVE_NAMES.next("all_gather")
    if sync_grads and torch.is_floating_point(tensor):
        return from_wire(_GatherSummingGradients.apply(for_wire(tensor, GATHER), name), tensor.dtype, GATHER)
    return from_wire(_allgather_stacked(for_wire(tensor.detach(), GATHER), name), tensor.dtype, GATHER)


def _allgather_stacked(wire: Tensor, name: str) -> Tensor:
    with torch.inference_mode(False):  # Horovod resizes the output on its own thread
        return horovod_torch().allgather(wire.clone().unsqueeze(0), name=name)


class _GatherSummingGradients(torch.autograd.Function):
    """Stacked allgather whose backward sums each slice's gradient over the workers."""

    @staticmethod
    def forward(ctx: Any, wire: Tensor, name: str) -> Tensor:
        ctx.name = name
        return _allgather_stacked(wire, name)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        hvd = horovod_torch()
        summed = hvd.allreduce(grad.contiguous(), op=hvd.Sum, name=f"{ctx.name}.grad")
        return summed[hvd.rank()], None


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` as rank ``src`` holds it, on every worker (pickled)."""
    return horovod_torch().broadcast_object(obj, root_rank=src, name=COLLECTIVE_NAMES.next("broadcast"))
