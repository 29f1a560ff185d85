"""Two-level allreduce that works on every Horovod build, with no process sets.

Horovod's own hierarchical allreduce needs the MPI controller and NCCL; under Gloo its flag
is silently ignored. Here each node first reduce-scatters (every local worker ends up with
1/L of the node's sum), the shards are summed across nodes among workers with the same
local rank (so all L workers share the cross-node traffic), and each node allgathers the
result. Every leg is a global alltoall that sends only to the worker's partners
(``comm.partners``), so Horovod runs no process set and never restarts.

Those are three collective rounds where a flat allreduce takes one, and a round costs the same
whatever its size until bytes dominate. Buffers below ``flat_below_bytes`` are therefore summed
by one flat allreduce over all workers (latency-bound: the round count decides), larger ones
take the three legs (bandwidth-bound: the cross-node bytes decide). See ``FLAT_BELOW_MB``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hvd_plugins.core.comm.compression import Compressor, NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.partners import (
    PendingGroupSum,
    finish_allgather,
    finish_reduce_scatter,
    group_sum,
    pad_to_multiple,
    start_allgather,
    start_reduce_scatter,
    wait_all,
)
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.comm.wire import nbytes


def _two_level(
    buffers: Sequence[torch.Tensor],
    groups: NodeGroups,
    local_codec: Compressor,
    cross_codec: Compressor,
    counters: CommCounters,
    name: str,
) -> list[torch.Tensor]:
    """Reduce-scatter inside the node, sum each shard across nodes, allgather inside the node."""
    local, cross = groups.local, groups.cross
    assert local is not None and cross is not None
    padded = [pad_to_multiple(buffer, local.size) for buffer in buffers]
    scatters = [start_reduce_scatter(b, local, local_codec, f"{name}.rs.{i}") for i, b in enumerate(padded)]
    for pending in scatters:
        counters.record(Scope.NODE_LOCAL, pending.piece_nbytes * local.size)
    with counters.waiting():
        shards = [finish_reduce_scatter(pending) for pending in scatters]
    totals = group_sum(shards, cross, cross_codec, f"{name}.xr", counters, Scope.CROSS_NODE)
    gathers = [start_allgather(t, local, local_codec, f"{name}.ag.{i}") for i, t in enumerate(totals)]
    for pending in gathers:
        counters.record(Scope.NODE_LOCAL, pending.piece_nbytes)
    with counters.waiting():
        return [finish_allgather(pending) for pending in gathers]


def hierarchical_allreduce_(
    buffers: Sequence[torch.Tensor],
    groups: NodeGroups,
    *,
    average: bool = True,
    compression: Compressor | None = None,
    compress_node_local: bool = False,
    counters: CommCounters | None = None,
    name: str = "hier",
    flat_below_bytes: int = 0,
) -> None:
    """Sum (or average) each 1-D buffer over all workers, in place, node by node.

    ``compression`` applies to what crosses nodes, and to the node-local legs too when
    ``compress_node_local`` is set. Buffers of fewer than ``flat_below_bytes`` bytes take one
    flat allreduce over all workers (counted as cross-node traffic of the whole buffer, and
    compressed as such); the others take the three legs. Every worker must call this with
    buffers of the same sizes and dtypes, in the same order. The flat allreduces start first
    and the legs run stage by stage while they are in flight, so Horovod can fuse and overlap.
    With a single node, or one worker per node, there is one leg only: a sum over every worker.
    """
    cross_codec = compression or NoCompression()
    local_codec = cross_codec if compress_node_local else NoCompression()
    counters = counters if counters is not None else CommCounters()
    local, cross = groups.local, groups.cross
    if local is None and cross is None:  # a job of one worker
        return

    if local is None or cross is None:
        group = local if local is not None else cross
        assert group is not None
        codec, scope = (local_codec, Scope.NODE_LOCAL) if local is not None else (cross_codec, Scope.CROSS_NODE)
        totals = group_sum(buffers, group, codec, f"{name}.ar", counters, scope)
    else:
        flat = [i for i, buffer in enumerate(buffers) if nbytes(buffer) < flat_below_bytes]
        legs = [i for i in range(len(buffers)) if i not in set(flat)]
        # One allreduce over every worker per small buffer, counted as cross-node traffic.
        world = groups.world
        pending = [PendingGroupSum(buffers[i], world, cross_codec, f"{name}.flat.{n}") for n, i in enumerate(flat)]
        for sum_ in pending:
            counters.record(Scope.CROSS_NODE, sum_.nbytes)
        leg_totals = _two_level([buffers[i] for i in legs], groups, local_codec, cross_codec, counters, name)
        by_index = dict(zip(legs, leg_totals, strict=True))
        with counters.waiting():
            by_index.update(zip(flat, wait_all(pending), strict=True))
        totals = [by_index[i] for i in range(len(buffers))]
    for buffer, total in zip(buffers, totals, strict=True):
        buffer.copy_(total[: buffer.numel()])
        if average:
            buffer.div_(groups.topology.size)
