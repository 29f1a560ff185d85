"""How an optimizer's trainable parameters split over the workers: flat buckets, one contiguous slice per worker.

Parameters are bucketed per param group, dtype and device (``comm.buckets``), in the order backward
produces their gradients (reversed), so a bucket's gradients are complete before backward ends. Each
bucket is one flat vector padded to a multiple of the number of workers (``comm.layout.FlatLayout``);
worker ``r`` owns slice ``r``. A worker reads and writes its slice straight from and into the
parameters (and their gradients), without building the bucket's flat vector.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch.nn import Parameter
from torch.optim import Optimizer

from hvd_plugins.core.comm.buckets import bucket_tensors
from hvd_plugins.core.comm.layout import FlatLayout
from hvd_plugins.core.comm.shards import LocalShard, ShardLayout


@dataclass(frozen=True)
class ShardedBucket:
    """Parameters of one param group laid end to end in a flat vector (``flat``); this worker owns its slice.

    ``unit``: with ``shard="parameters"``, the unit whose parameters these are: between its computations they
    exist only as the workers' slices, so the layout keeps their shapes (taken when it was laid out).
    """

    group_index: int
    parameters: tuple[Parameter, ...]
    flat: FlatLayout
    unit: int | None = None

    @property
    def layout(self) -> ShardLayout:
        """How the flat vector splits over the workers, and which slice is this worker's."""
        return self.flat.shard

    @property
    def shapes(self) -> tuple[torch.Size, ...]:
        return self.flat.shapes

    def local_shards(self, slice_values: torch.Tensor) -> list[tuple[Parameter, LocalShard]]:
        """This worker's part of each parameter it holds any of, as views of ``slice_values`` (its slice)."""
        return [
            (self.parameters[position], LocalShard(values, start, self.flat.shapes[position]))
            for position, values, start in self.flat.slice_views(slice_values)
        ]

    def read_slice(self, tensors: Sequence[torch.Tensor | None], into: torch.Tensor) -> torch.Tensor:
        """This worker's slice of the flat vector of ``tensors`` (one per parameter, None as zeros), into ``into``."""
        return self.flat.read_slice(tensors, into)

    def write_slice(self, values: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this worker's slice ``values`` into the matching parts of ``tensors`` (one per parameter)."""
        self.flat.write_slice(values, tensors)


Signature = Callable[[Parameter], Hashable]
"""What must be equal for two parameters to share a bucket beyond group, dtype and device: the optimizer's
scalar state (Adam's step count), which a bucket's slice holds once for all its parameters."""


def partition(
    optimizer: Optimizer, workers: int, rank: int, bucket_bytes: int, signature: Signature | None = None
) -> list[ShardedBucket]:
    """The buckets of ``optimizer``'s trainable parameters, each split into ``workers`` slices (this is ``rank``)."""
    buckets = []
    for group_index, group in enumerate(optimizer.param_groups):
        trainable: list[Parameter] = [p for p in group["params"] if p.requires_grad]
        buckets += [
            ShardedBucket(group_index, bucket.parameters, bucket.flat)
            for bucket in _bucketed(trainable, workers, rank, bucket_bytes, signature)
        ]
    return buckets


def _bucketed(
    parameters: Sequence[Parameter], workers: int, rank: int, bucket_bytes: int, signature: Signature | None
) -> list[ShardedBucket]:
    """``parameters`` of one param group in buckets of about ``bucket_bytes``, by signature (group index 0)."""
    alike: dict[Hashable, list[Parameter]] = {}
    for parameter in parameters:
        alike.setdefault(signature(parameter) if signature is not None else None, []).append(parameter)
    buckets = []
    for members_alike in alike.values():
        for members in bucket_tensors(reversed(members_alike), bucket_bytes):
            chosen = cast(tuple[Parameter, ...], tuple(members))  # bucket_tensors keeps what it was given
            buckets.append(ShardedBucket(0, chosen, FlatLayout.of(chosen, workers, rank)))
    return buckets


def trainable_groups(optimizer: Optimizer) -> list[list[Parameter]]:
    """The trainable parameters of each of ``optimizer``'s param groups: what it steps."""
    return [[p for p in group["params"] if p.requires_grad] for group in optimizer.param_groups]


def partition_by_units(
    groups: Sequence[Sequence[Parameter]],
    owners: Mapping[int, int],
    workers: int,
    rank: int,
    bucket_bytes: int,
    signature: Signature | None = None,
    units_only: bool = False,
    shapes: Mapping[int, torch.Size] | None = None,
) -> list[ShardedBucket]:
    """``shard="parameters"``: ``groups`` (the parameters to lay out, by param group) in one bucket per unit
    (``owners``: parameter id -> unit), param group, dtype and signature, the later units first (backward reaches them
    first); the parameters of no unit as ``partition`` lays them out, or, with ``units_only``, not at all (whole).
    ``shapes``: the whole shape of each parameter by id, where a parameter now holds only its shard."""
    whole = shapes or {}
    buckets = []
    for group_index, group in enumerate(groups):
        by_unit: dict[tuple[int, Hashable], list[Parameter]] = {}
        rest: list[Parameter] = []
        for parameter in group:
            unit = owners.get(id(parameter))
            if unit is None:
                if not units_only:
                    rest.append(parameter)
                continue
            alike = (signature(parameter) if signature is not None else None, parameter.dtype, parameter.device)
            by_unit.setdefault((unit, alike), []).append(parameter)
        for (unit, _), members in sorted(by_unit.items(), key=lambda item: -item[0][0]):
            layout = FlatLayout([whole.get(id(p), p.shape) for p in members], workers, rank)
            buckets.append(ShardedBucket(group_index, tuple(members), layout, unit))
        buckets += [
            ShardedBucket(group_index, bucket.parameters, bucket.flat)
            for bucket in _bucketed(rest, workers, rank, bucket_bytes, signature)
        ]
    return buckets
