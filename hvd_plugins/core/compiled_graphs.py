"""``torch.compile`` and gradient sync: graphs cut at bucket boundaries, so allreduces overlap backward.

A model compiled as one graph gets one backward function: every gradient becomes ready when it
returns, at the very end of backward, and the sync has nothing left to overlap with. torch's DDP
avoids this with dynamo's ``DDPOptimizer``, which cuts the captured graph where a gradient bucket
fills, counting parameters backwards from the output, and compiles each piece on its own: the
pieces' backwards then hand their gradients over one after another, and the allreduces that the
gradient hooks start (Horovod's per parameter, or a bucket's) run while the earlier pieces'
backwards compute. The cut changes where graphs end, not what they compute.

Dynamo cuts only while it believes a DDP module runs (it asks ``DistributedDataParallel`` for the
active one when it captures a frame); ``GraphCuts`` names a stand-in that carries the
bucket size while ``GraphCuts`` is open. Graphs captured while it is closed stay whole, and graphs
already compiled are reused as they are. No collective runs inside a compiled graph either way: the
syncs start from gradient hooks, which autograd runs outside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FIRST_BUCKET_BYTES = 1 << 20
"""The first piece (the last layers' parameters) holds 1 MiB, as DDP's first bucket, so a sync starts early."""


@dataclass(frozen=True)
class _BucketedModule:
    """What dynamo reads of the DDP module it believes active: the bucket size, in bytes."""

    bucket_bytes_cap: int


def _ddp_class() -> Any | None:
    """torch's ``DistributedDataParallel`` where it has the slot dynamo reads, else None (then graphs stay whole)."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel if hasattr(DistributedDataParallel, "_active_ddp_module") else None


class GraphCuts:
    """While open, a graph ``torch.compile`` captures is cut every ``bucket_bytes`` of trainable parameters.

    A strategy opens it when it sets a model up and closes it at teardown, so every graph of the fit (its
    training steps, and the evaluation in between, where the cut costs nothing) is captured inside.
    """

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = max(int(bucket_bytes), FIRST_BUCKET_BYTES)
        self._previous: Any = None
        self._stand_in: _BucketedModule | None = None

    def open(self) -> None:
        ddp = _ddp_class()
        if ddp is None or self._stand_in is not None:
            return
        self._previous, self._stand_in = ddp._active_ddp_module, _BucketedModule(self.bucket_bytes)
        ddp._active_ddp_module = self._stand_in

    def close(self) -> None:
        ddp = _ddp_class()
        if ddp is None or self._stand_in is None:
            return
        if ddp._active_ddp_module is self._stand_in:  # else someone else's module is active now: leave it
            ddp._active_ddp_module = self._previous
        self._previous, self._stand_in = None, None
