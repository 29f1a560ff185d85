"""Two-level allreduce built from process sets, so it works on every Horovod build.

Horovod's own hierarchical allreduce needs the MPI controller and NCCL; under Gloo its flag
is silently ignored. Here each node first reduce-scatters (every local worker ends up with
1/L of the node's sum), the shards are allreduced across nodes among workers with the same
local rank (so all L workers share the cross-node traffic), and each node allgathers the
result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hvd_plugins._horovod import horovod_torch
from hvd_plugins.comm.compression import Compressor, NoCompression
from hvd_plugins.comm.counters import CommCounters, Scope
from hvd_plugins.comm.topology import NodeGroups
from hvd_plugins.comm.wire import nbytes


def _leg(
    inputs: Sequence[torch.Tensor],
    codec: Compressor,
    scope: Scope,
    counters: CommCounters,
    start: Callable[..., Any],
    name: str,
    **options: Any,
) -> list[torch.Tensor]:
    """One stage on every input: compress, count the bytes and start each; then wait for all and decompress.

    ``start(wire, name=f"{name}.{index}", **options)`` starts the Horovod op of input ``index``.
    Starting every input before waiting on any lets Horovod fuse and overlap them.
    """
    pending = []
    for index, tensor in enumerate(inputs):
        wire, ctx = codec.compress(tensor)
        counters.record(scope, nbytes(wire))
        pending.append((start(wire, name=f"{name}.{index}", **options), ctx))
    hvd = horovod_torch()
    with counters.waiting():
        return [codec.decompress(hvd.synchronize(handle), ctx) for handle, ctx in pending]


def _pad_to_multiple(buffer: torch.Tensor, parts: int) -> torch.Tensor:
    """``buffer`` zero-padded so it splits into ``parts`` equal shards."""
    remainder = buffer.numel() % parts
    return torch.cat([buffer, buffer.new_zeros(parts - remainder)]) if remainder else buffer


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
    local, cross = groups.local, groups.cross

    if local is None or cross is None:
        # One leg only: a single node (allreduce inside it) or one worker per node.
        if local is None and cross is None:  # a job of one worker
            return
        process_set = local if local is not None else cross
        codec, scope = (local_codec, Scope.NODE_LOCAL) if local is not None else (cross_codec, Scope.CROSS_NODE)
        ar = hvd.allreduce_async
        totals = _leg(buffers, codec, scope, counters, ar, f"{name}.ar", op=hvd.Sum, process_set=process_set)
    else:
        # Reduce-scatter inside the node (each local worker gets 1/L of the node's sum), allreduce
        # each shard across nodes among the workers with this local rank, allgather inside the node.
        padded = [_pad_to_multiple(buffer, groups.topology.local_size) for buffer in buffers]
        rs, xr, ag = hvd.reducescatter_async, hvd.allreduce_async, hvd.allgather_async
        shards = _leg(padded, local_codec, Scope.NODE_LOCAL, counters, rs, f"{name}.rs", op=hvd.Sum, process_set=local)
        shards = _leg(shards, cross_codec, Scope.CROSS_NODE, counters, xr, f"{name}.xr", op=hvd.Sum, process_set=cross)
        totals = _leg(shards, local_codec, Scope.NODE_LOCAL, counters, ag, f"{name}.ag", process_set=local)
    for buffer, total in zip(buffers, totals, strict=True):
        buffer.copy_(total[: buffer.numel()])
        if average:
            buffer.div_(groups.topology.size)
