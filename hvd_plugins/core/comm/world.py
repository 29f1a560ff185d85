"""Every worker of the job, for a sync mode: who this worker is, and the few blocking collectives a mode needs
between steps (a norm over slices, a newly trainable parameter's average, a route measurement, an elastic commit's
parts). Gradients travel through the in-flight sums of ``reducer``, ``partners`` and ``two_level`` instead.

Each function is a collective where it says so: every worker calls it at the same point with the same ``name``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.waits import wait_for
from hvd_plugins.core.comm.partners import PartnerGroup, start_one_way


def world_size() -> int:
    """How many workers the job has now."""
    return int(horovod_torch().size())


def world_rank() -> int:
    """This worker's rank among them."""
    return int(horovod_torch().rank())


def spans_nodes() -> bool:
    """Whether the workers run on more than one host."""
    return int(horovod_torch().cross_size()) > 1


def world_group() -> PartnerGroup:
    """Every worker as one group, in rank order."""
    size = world_size()
    return PartnerGroup(tuple(range(size)), world_rank(), size)


def sum_over_world(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` summed over every worker (a collective; ``tensor`` itself is left as it is)."""
    hvd = horovod_torch()
    return tensor if hvd.size() == 1 else hvd.allreduce(tensor, op=hvd.Sum, name=name)


def average_over_world(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` averaged over every worker (a collective)."""
    hvd = horovod_torch()
    return tensor if hvd.size() == 1 else hvd.allreduce(tensor, op=hvd.Average, name=name)


def max_over_world(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The elementwise maximum of ``tensor`` over every worker (a collective)."""
    hvd = horovod_torch()
    return tensor if hvd.size() == 1 else hvd.allreduce(tensor, op=hvd.Max, name=name)


def gather_over_world(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along its first dimension in rank order (a collective; the first
    dimensions may differ between workers)."""
    hvd = horovod_torch()
    return tensor if hvd.size() == 1 else hvd.allgather(tensor, name=name)


def broadcast_from_root(tensors: Sequence[torch.Tensor], name: str) -> None:
    """Rank 0's values of ``tensors`` written into every worker's, in place (a collective; one name per tensor)."""
    hvd = horovod_torch()
    if hvd.size() > 1 and tensors:
        named = [(f"{name}.{index}", tensor.detach()) for index, tensor in enumerate(tensors)]
        hvd.broadcast_parameters(named, root_rank=0)


def send_one_way(tensor: torch.Tensor, to: int, name: str) -> torch.Tensor:
    """Send ``tensor`` to worker ``to`` and return what the worker sending to this one sent (a collective in which
    each worker sends to one and receives from one: a ring, or any permutation)."""
    return wait_for(start_one_way(tensor, to, world_size(), name))[0]
