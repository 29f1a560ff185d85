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
take the three legs (bandwidth-bound: the cross-node bytes decide).

Each buffer's sum is an operation in flight (``start_bucket_sum``, ``comm.in_flight``): a training
step can start one as soon as backward has produced its gradients (``comm.reducer``) and let it
move from leg to leg while backward still runs, then finish them all after backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hvd_plugins.core.comm.compression import Compressor, NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.in_flight import InFlight, Meanwhile, finish_all
from hvd_plugins.core.comm.partners import (
    GroupSum,
    PartnerAlltoall,
    PartnerGroup,
    finish_allgather,
    finish_reduce_scatter,
    start_allgather,
    start_reduce_scatter,
)
from hvd_plugins.core.comm.shards import ShardLayout
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.comm.wire import nbytes


class OneLevelSum(InFlight[torch.Tensor]):
    """A sum over one group (one flat allreduce, or a partner sum where a level is missing)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        group: PartnerGroup,
        codec: Compressor,
        counters: CommCounters,
        scope: Scope,
        name: str,
    ) -> None:
        self.counters = counters
        self._sum = GroupSum(buffer, group, codec, name)
        if self._sum.nbytes:
            counters.record(scope, self._sum.nbytes)
        self._total: torch.Tensor | None = None

    def progress(self) -> None:
        if self._total is None and self._sum.ready():
            self._wait_leg()

    def ready(self) -> bool:
        self.progress()
        return self._total is not None

    def wait(self, meanwhile: Meanwhile = None) -> torch.Tensor:
        if self._total is None:
            if meanwhile is not None:
                meanwhile()
            self._wait_leg()
        assert self._total is not None
        return self._total

    def _wait_leg(self) -> None:
        with self.counters.waiting():
            self._total = self._sum.wait()


class TwoLevelSum(InFlight[torch.Tensor]):
    """Reduce-scatter inside the node, sum the shard across nodes, allgather inside the node: one leg at a time.

    With ``keep_shard`` the last leg is left out: the result is this worker's shard of the sum (the
    buffer padded to a multiple of the node's workers, shard ``local_rank``), as sharding inside the node needs.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        groups: NodeGroups,
        local_codec: Compressor,
        cross_codec: Compressor,
        counters: CommCounters,
        name: str,
        keep_shard: bool = False,
    ) -> None:
        assert groups.local is not None and groups.cross is not None
        self.keep_shard = keep_shard
        self.local, self.cross = groups.local, groups.cross
        self.local_codec, self.cross_codec = local_codec, cross_codec
        self.counters = counters
        self.name = name
        padded = ShardLayout(buffer.numel(), self.local.size, self.local.index).padded(buffer)
        self._scatter: PartnerAlltoall | None = start_reduce_scatter(padded, self.local, local_codec, f"{name}.rs")
        counters.record(Scope.NODE_LOCAL, self._scatter.piece_nbytes * self.local.size)
        self._cross: GroupSum | None = None
        self._gather: PartnerAlltoall | None = None
        self._total: torch.Tensor | None = None

    def progress(self) -> None:
        if self._scatter is not None and self._scatter.ready():
            self._wait_leg()
        if self._cross is not None and self._cross.ready():
            self._wait_leg()
        if self._gather is not None and self._gather.ready():
            self._wait_leg()

    def ready(self) -> bool:
        self.progress()
        return self._total is not None

    def wait(self, meanwhile: Meanwhile = None) -> torch.Tensor:
        """The sum, at least as long as the buffer (padding at the end)."""
        while self._total is None:
            if meanwhile is not None:
                meanwhile()
            self._wait_leg()
        return self._total

    def _wait_leg(self) -> None:
        """Wait for the current leg and start the next (or finish)."""
        with self.counters.waiting():
            if self._scatter is not None:
                shard = finish_reduce_scatter(self._scatter)
                self._scatter = None
                self._cross = GroupSum(shard, self.cross, self.cross_codec, f"{self.name}.xr")
                if self._cross.nbytes:
                    self.counters.record(Scope.CROSS_NODE, self._cross.nbytes)
            elif self._cross is not None:
                total = self._cross.wait()
                self._cross = None
                if self.keep_shard:
                    self._total = total
                    return
                self._gather = start_allgather(total, self.local, self.local_codec, f"{self.name}.ag")
                self.counters.record(Scope.NODE_LOCAL, self._gather.piece_nbytes)
            elif self._gather is not None:
                self._total = finish_allgather(self._gather)
                self._gather = None


def start_bucket_sum(
    buffer: torch.Tensor,
    groups: NodeGroups,
    *,
    compression: Compressor | None = None,
    compress_node_local: bool = False,
    counters: CommCounters,
    name: str,
    flat_below_bytes: int = 0,
) -> InFlight[torch.Tensor] | None:
    """Start summing one 1-D buffer over every worker, node by node; None in a job of one worker.

    ``compression`` applies to what crosses nodes, and to the node-local legs too when
    ``compress_node_local`` is set. A buffer of fewer than ``flat_below_bytes`` bytes takes one flat
    allreduce over all workers (counted as cross-node traffic of the whole buffer, compressed as
    such); a larger one the three legs. With a single node, or one worker per node, there is one
    leg only: a sum over every worker. Every worker must start the same sums (same names, sizes and
    dtypes), in any order.
    """
    cross_codec = compression or NoCompression()
    local_codec = cross_codec if compress_node_local else NoCompression()
    local, cross = groups.local, groups.cross
    if local is None and cross is None:
        return None
    if local is None or cross is None:
        group = local if local is not None else cross
        assert group is not None
        codec, scope = (local_codec, Scope.NODE_LOCAL) if local is not None else (cross_codec, Scope.CROSS_NODE)
        return OneLevelSum(buffer, group, codec, counters, scope, f"{name}.ar")
    if nbytes(buffer) < flat_below_bytes:
        return OneLevelSum(buffer, groups.world, cross_codec, counters, Scope.CROSS_NODE, f"{name}.flat")
    return TwoLevelSum(buffer, groups, local_codec, cross_codec, counters, name)


def write_total(buffer: torch.Tensor, total: torch.Tensor, divide_by: int | None) -> None:
    """Copy a sum back into its buffer (dropping the padding), divided by ``divide_by`` when given."""
    buffer.copy_(total[: buffer.numel()])
    if divide_by is not None:
        buffer.div_(divide_by)


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
    """Sum (or average) each 1-D buffer over all workers, in place, node by node (see ``start_bucket_sum``).

    Every worker must call this with buffers of the same sizes and dtypes, in the same order. All
    sums start at once, so while one waits for a leg the others can move on.
    """
    counters = counters if counters is not None else CommCounters()
    pending = [
        start_bucket_sum(
            buffer,
            groups,
            compression=compression,
            compress_node_local=compress_node_local,
            counters=counters,
            name=f"{name}.{index}",
            flat_below_bytes=flat_below_bytes,
        )
        for index, buffer in enumerate(buffers)
    ]
    started = [(buffer, sum_) for buffer, sum_ in zip(buffers, pending, strict=True) if sum_ is not None]
    totals = finish_all([sum_ for _, sum_ in started])
    for (buffer, _), total in zip(started, totals, strict=True):
        write_total(buffer, total, groups.topology.size if average else None)
