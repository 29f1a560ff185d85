"""Sums across nodes of what every worker of a node holds alike, carried shard by shard by the node's workers.

Every local worker ``i`` carries shard ``i`` (``comm.shards``) across nodes, summed with the workers of
its local rank on the other nodes, in chunks; the node then gathers the sums. The bytes between
nodes are one copy per node, not one per worker, and the cross-node message is split across all L
local workers instead of carried by one. Both legs reach the worker's partners through global
alltoalls (``comm.partners``); with one worker per node the cross-node sum is Horovod's allreduce.
DASO's parameter merges and closing syncs move their bytes here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hvd_plugins.core.comm.compression import NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.in_flight import InFlight, Meanwhile, finish_all
from hvd_plugins.core.comm.partners import GroupSum, finish_allgather, start_allgather
from hvd_plugins.core.comm.shards import ShardLayout
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.comm.wire import nbytes


class ChunkedSum(InFlight[torch.Tensor]):
    """A cross-node sum in flight, one group sum per chunk; ``wait()`` returns it whole, in its wire type."""

    def __init__(self, chunks: list[GroupSum], dtype: torch.dtype) -> None:
        self.chunks = chunks
        self.dtype = dtype

    def progress(self) -> None:
        for chunk in self.chunks:
            chunk.progress()

    def ready(self) -> bool:
        return all(chunk.ready() for chunk in self.chunks)

    def wait(self, meanwhile: Meanwhile = None) -> torch.Tensor:
        """The cross-node group is a relaying pair, every worker (Horovod's allreduce) or a larger group
        (reduce-scatter, then an allgather in the wire type): each ends with the sum in the wire type,
        so converting back to it is exact."""
        parts = finish_all(self.chunks) if meanwhile is None else [chunk.wait(meanwhile) for chunk in self.chunks]
        return torch.cat(parts).to(self.dtype) if parts else torch.empty(0, dtype=self.dtype)


class CrossNodeSharding:
    """Sum shards across nodes and reassemble them inside the node; counts every byte."""

    def __init__(self, groups: NodeGroups, counters: CommCounters, chunk_numel: int) -> None:
        cross = groups.cross
        if cross is not None and cross.size == 2 and not (cross.relays or cross.spans_world):
            # A pair that exchanges returns its float32 sum of two wire pieces; gathering that in the
            # wire type would round it, so the merge relies on the relay (or allreduce) of a pair.
            raise ValueError(f"the cross-node pair {cross.ranks} must relay (a relay lane) or span every worker")
        self.groups = groups
        self.counters = counters
        self.chunk_numel = chunk_numel
        self.num_nodes = groups.topology.num_nodes

    def layout(self, numel: int) -> ShardLayout:
        """Which shard of a ``numel``-element vector this worker carries across nodes."""
        local = self.groups.local
        return ShardLayout(numel, local.size, local.index) if local is not None else ShardLayout(numel, 1, 0)

    def start_sum(self, wire: torch.Tensor, name: str) -> ChunkedSum:
        """Start a non-blocking Sum of ``wire`` over this worker's cross-node peers, chunk by chunk."""
        assert self.groups.cross is not None
        chunks = wire.split(self.chunk_numel) if wire.numel() else ()
        codec = NoCompression()  # ``wire`` is already in its wire type
        pending = [GroupSum(chunk, self.groups.cross, codec, f"{name}.{i}") for i, chunk in enumerate(chunks)]
        self.counters.record(Scope.CROSS_NODE, nbytes(wire), calls=len(pending))
        return ChunkedSum(pending, wire.dtype)

    def finish_sums(self, pending: Sequence[ChunkedSum]) -> list[torch.Tensor]:
        """Wait for sums started together; each in its wire type."""
        with self.counters.waiting():
            return finish_all(pending)

    def gather_in_node(self, shard: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        """Every local worker's ``shard``, reassembled and unpadded: the full flat vector (one round)."""
        return self.gather_all_in_node([shard], [layout])[0]

    def gather_all_in_node(self, shards: Sequence[torch.Tensor], layouts: Sequence[ShardLayout]) -> list[torch.Tensor]:
        """``gather_in_node`` for several shards at once: all gathers start before any is awaited."""
        local = self.groups.local
        if local is None:
            return [shard[: layout.numel] for shard, layout in zip(shards, layouts, strict=True)]
        codec = NoCompression()
        pending = [start_allgather(shard, local, codec, f"node_shards.gather.{i}") for i, shard in enumerate(shards)]
        for gather in pending:
            self.counters.record(Scope.NODE_LOCAL, gather.piece_nbytes)
        with self.counters.waiting():
            return [finish_allgather(gather)[: layout.numel] for gather, layout in zip(pending, layouts, strict=True)]

    def sum_node_copies(self, messages: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        """The sum over nodes of messages that every worker of a node holds alike, each in its own type.

        Each local worker carries its shard of every message across nodes, then the node gathers
        the sums: the bytes between nodes are one copy per node, not one per worker, as an
        allreduce over all workers would send. All sums start before any is awaited.
        """
        layouts = [self.layout(message.numel()) for message in messages]
        pending = [
            self.start_sum(layout.shard_of(message), f"{name}.{index}")
            for index, (message, layout) in enumerate(zip(messages, layouts, strict=True))
        ]
        return self.gather_all_in_node(self.finish_sums(pending), layouts)
