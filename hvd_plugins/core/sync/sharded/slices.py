"""This worker's flat slices of a set of buckets: the memory sharded parameters live in.

A bucket (``partition``) lays parameters end to end; each worker keeps one contiguous slice of it. Under
``shard="parameters"`` a unit's parameters are views of those slices between its computations, and an optimizer
steps them in place. ``BucketSlices`` is that storage alone, whoever steps it: ``ShardedOptimizer`` is one that an
optimizer of the user's class steps; the units' parameters that no optimizer steps (frozen ones, and all of them
while none is set up) keep their slices in one of their own, which nothing steps and which holds no state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import Parameter

from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.partners import PartnerGroup
from hvd_plugins.core.sync.meta import make_parameter_real, replace_values
from hvd_plugins.core.sync.sharded.partition import ShardedBucket


class BucketSlices:
    """This worker's slice of each of ``buckets``, read from the parameters, or left for ``fill_slice`` (or
    ``adopt_slice``) where they hold shards now; gathered over ``world`` as ``name``'s."""

    def __init__(
        self,
        buckets: Sequence[ShardedBucket],
        world: PartnerGroup | None,
        counters: CommCounters,
        scope: Scope,
        name: str,
    ) -> None:
        self.buckets = list(buckets)
        self.world = world
        self.counters, self.scope, self.name = counters, scope, name
        self.slices: list[Parameter] = []
        self._unfilled: set[int] = set()
        self._lay_out()

    def _lay_out(self) -> None:
        self._lay_out_slices()

    def _lay_out_slices(self) -> None:
        """A slice for each of the current buckets."""
        self._unfilled = set()
        self.slices = [self._new_slice(index, bucket) for index, bucket in enumerate(self.buckets)]

    def _new_slice(self, index: int, bucket: ShardedBucket) -> Parameter:
        """This worker's slice of ``bucket``, read from its whole parameters; where they are a model's shards
        (``shard="parameters"``, set up before this store), left for ``fill_slice`` once their unit is whole."""
        first = bucket.parameters[0]
        if any(p.shape != shape for p, shape in zip(bucket.parameters, bucket.shapes, strict=True)):
            self._unfilled.add(index)  # no memory until filled, or given the slice the model holds (``adopt_slice``)
            size = bucket.layout.shard_numel if first.is_meta else 0
            return Parameter(torch.empty(size, dtype=first.dtype, device=first.device))
        values = torch.empty(bucket.layout.shard_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            bucket.read_slice([p.detach() for p in bucket.parameters], values)
        return Parameter(values)

    def release_slices(self) -> None:
        """Dropped for good (another store took its units over): the slices' memory goes now."""
        for piece in self.slices:
            piece.data = piece.data.new_empty(0)
            piece.grad = None

    def unfilled(self, index: int) -> bool:
        """Whether bucket ``index``'s slice still waits for its parameters to be whole (``fill_slice``)."""
        return index in self._unfilled

    def fill_slice(self, index: int, device: torch.device) -> None:
        """Bucket ``index``'s slice read from its whole parameters as they are now; laid out over a model on the meta
        device, the slice is first made real on ``device`` (the same Parameter, which an optimizer may hold)."""
        bucket, piece = self.buckets[index], self.slices[index]
        self._unfilled.discard(index)
        if piece.is_meta:
            make_parameter_real(piece, device)
        elif piece.numel() != bucket.layout.shard_numel:  # left empty at construction
            piece.data = torch.empty(bucket.layout.shard_numel, dtype=piece.dtype, device=device)
        with torch.no_grad():
            bucket.read_slice([p.detach() for p in bucket.parameters], piece.data)

    def adopt_slice(self, index: int, values: torch.Tensor) -> None:
        """Bucket ``index``'s slice made ``values`` itself, no copy: the slice the model held for a unit laid out as
        this bucket is (its old store let go), which the unit's parameters go on viewing."""
        piece = self.slices[index]
        assert values.shape == (self.buckets[index].layout.shard_numel,) and values.dtype == piece.dtype
        self._unfilled.discard(index)
        if piece.is_meta:
            replace_values(piece, values)
        else:
            piece.data = values

    def parameter_ids(self) -> set[int]:
        """The parameters these slices hold, by id."""
        return {id(p) for bucket in self.buckets for p in bucket.parameters}


def unstepped_slices(
    buckets: Sequence[ShardedBucket], world: PartnerGroup | None, counters: CommCounters, scope: Scope
) -> BucketSlices:
    """The slices of units' parameters that no optimizer steps: no gradient ever lands in them."""
    store = BucketSlices(buckets, world, counters, scope, "shard.unstepped")
    for piece in store.slices:
        piece.requires_grad_(False)
    return store
