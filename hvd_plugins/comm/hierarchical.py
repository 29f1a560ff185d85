"""Two-level allreduce built from process sets, so it works on every Horovod build.

Horovod's own hierarchical allreduce needs the MPI controller and NCCL; under Gloo its flag
is silently ignored. Here each node first reduce-scatters (every local worker ends up with
1/L of the node's sum), the shards are allreduced across nodes among workers with the same
local rank (so all L workers share the cross-node traffic), and each node allgathers the
result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hvd_plugins._horovod import horovod_torch
from hvd_plugins.comm.compression import Compressor, NoCompression
from hvd_plugins.comm.counters import CommCounters, Scope
from hvd_plugins.comm.topology import NodeGroups


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def hierarchical_allreduce_(
    buffers: Sequence[torch.Tensor],
    groups: NodeGroups,
    *,
    average: bool = True,
    compression: Compressor | None = None,
    compress_node_local: bool = False,
    counters: CommCounters | None = None,
    name: str = "hier",
) -> None:
    """Sum (or average) each 1-D buffer over all workers, in place, node by node.

    ``compression`` applies to the cross-node leg, and to the node-local legs too when
    ``compress_node_local`` is set. Every worker must call this with buffers of the same sizes
    and dtypes, in the same order. Buckets are processed stage by stage so Horovod can fuse
    and overlap them.
    """
    hvd = horovod_torch()
    cross_codec = compression or NoCompression()
    local_codec = cross_codec if compress_node_local else NoCompression()
    counters = counters if counters is not None else CommCounters()
    topology = groups.topology
    world = topology.size
    local_size = topology.local_size

    if groups.local is None or groups.cross is None:
        # One leg only: a single node (allreduce inside it) or one worker per node.
        process_set = groups.local if groups.local is not None else groups.cross
        codec, scope = (local_codec, Scope.NODE_LOCAL) if groups.local is not None else (cross_codec, Scope.CROSS_NODE)
        if process_set is None:  # a job of one worker
            return
        pending = []
        for index, buffer in enumerate(buffers):
            wire, ctx = codec.compress(buffer)
            counters.record(scope, _nbytes(wire))
            handle = hvd.allreduce_async(wire, op=hvd.Sum, name=f"{name}.ar.{index}", process_set=process_set)
            pending.append((buffer, handle, ctx))
        with counters.waiting():
            for buffer, handle, ctx in pending:
                buffer.copy_(codec.decompress(hvd.synchronize(handle), ctx))
                if average:
                    buffer.div_(world)
        return

    # Leg 1: reduce-scatter inside the node. Pad so the buffer splits into L equal shards.
    padded, scattered = [], []
    for index, buffer in enumerate(buffers):
        remainder = buffer.numel() % local_size
        full = torch.cat([buffer, buffer.new_zeros(local_size - remainder)]) if remainder else buffer
        padded.append(full)
        wire, ctx = local_codec.compress(full)
        counters.record(Scope.NODE_LOCAL, _nbytes(wire))
        handle = hvd.reducescatter_async(wire, op=hvd.Sum, name=f"{name}.rs.{index}", process_set=groups.local)
        scattered.append((handle, ctx))
    with counters.waiting():
        shards = [local_codec.decompress(hvd.synchronize(handle), ctx) for handle, ctx in scattered]

    # Leg 2: allreduce each shard across nodes, among the workers with this local rank.
    crossing = []
    for index, shard in enumerate(shards):
        wire, ctx = cross_codec.compress(shard)
        counters.record(Scope.CROSS_NODE, _nbytes(wire))
        handle = hvd.allreduce_async(wire, op=hvd.Sum, name=f"{name}.xr.{index}", process_set=groups.cross)
        crossing.append((handle, ctx))
    with counters.waiting():
        shards = [cross_codec.decompress(hvd.synchronize(handle), ctx) for handle, ctx in crossing]

    # Leg 3: allgather the reduced shards inside the node.
    gathering = []
    for index, shard in enumerate(shards):
        wire, ctx = local_codec.compress(shard)
        counters.record(Scope.NODE_LOCAL, _nbytes(wire))
        handle = hvd.allgather_async(wire, name=f"{name}.ag.{index}", process_set=groups.local)
        gathering.append((handle, ctx))
    with counters.waiting():
        for buffer, (handle, ctx) in zip(buffers, gathering, strict=True):
            total = local_codec.decompress(hvd.synchronize(handle), ctx)[: buffer.numel()]
            buffer.copy_(total)
            if average:
                buffer.div_(world)
