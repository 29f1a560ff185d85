"""How an optimizer's trainable parameters split over the workers: flat buckets, one contiguous slice per worker.

Parameters are bucketed per param group, dtype and device (``comm.buckets``), in the order backward
produces their gradients (reversed), so a bucket's gradients are complete before backward ends. Each
bucket is one flat vector padded to a multiple of the number of workers (``comm.shards.ShardLayout``);
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
from hvd_plugins.core.comm.shards import LocalShard, ShardLayout


@dataclass(frozen=True)
class ShardedBucket:
    """Parameters of one param group laid end to end in a flat vector; this worker owns ``layout``'s slice.

    ``unit``: with ``shard="parameters"``, the unit whose parameters these are: between its computations they
    exist only as the workers' slices, so the bucket keeps their ``shapes`` (taken when it was laid out).
    """

    group_index: int
    parameters: tuple[Parameter, ...]
    layout: ShardLayout
    unit: int | None = None
    shapes: tuple[torch.Size, ...] = ()

    def __post_init__(self) -> None:
        if not self.shapes:
            object.__setattr__(self, "shapes", tuple(parameter.shape for parameter in self.parameters))

    @property
    def offsets(self) -> list[int]:
        """Where each parameter starts in the bucket's flat vector."""
        starts, offset = [], 0
        for shape in self.shapes:
            starts.append(offset)
            offset += shape.numel()
        return starts

    def _overlaps(self) -> list[tuple[Parameter, slice, slice]]:
        """For each parameter that overlaps this worker's slice: (parameter, its part, where in the slice)."""
        begin, end = self.layout.start, self.layout.start + self.layout.shard_numel
        found = []
        for parameter, offset, shape in zip(self.parameters, self.offsets, self.shapes, strict=True):
            low, high = max(offset, begin), min(offset + shape.numel(), end)
            if low < high:
                found.append((parameter, slice(low - offset, high - offset), slice(low - begin, high - begin)))
        return found

    def local_shards(self, slice_values: torch.Tensor) -> list[tuple[Parameter, LocalShard]]:
        """This worker's part of each parameter it holds any of, as views of ``slice_values`` (its slice)."""
        shapes = {id(parameter): shape for parameter, shape in zip(self.parameters, self.shapes, strict=True)}
        return [
            (parameter, LocalShard(slice_values[place], part.start, shapes[id(parameter)]))
            for parameter, part, place in self._overlaps()
        ]

    def read_slice(self, tensors: Sequence[torch.Tensor | None], into: torch.Tensor) -> torch.Tensor:
        """This worker's slice of the flat vector of ``tensors`` (one per parameter, None as zeros), into ``into``."""
        into.zero_()
        by_parameter = dict(zip(self.parameters, tensors, strict=True))
        for parameter, part, place in self._overlaps():
            tensor = by_parameter[parameter]
            if tensor is not None:
                into[place].copy_(tensor.reshape(-1)[part])
        return into

    def write_slice(self, values: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this worker's slice ``values`` into the matching parts of ``tensors`` (one per parameter)."""
        by_parameter = dict(zip(self.parameters, tensors, strict=True))
        for parameter, part, place in self._overlaps():
            by_parameter[parameter].view(-1)[part].copy_(values[place])


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
            ShardedBucket(group_index, bucket.parameters, bucket.layout)
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
            numel = sum(p.numel() for p in members)
            chosen = cast(tuple[Parameter, ...], tuple(members))  # bucket_tensors keeps what it was given
            buckets.append(ShardedBucket(0, chosen, ShardLayout(numel, workers, rank)))
    return buckets


def partition_by_units(
    optimizer: Optimizer,
    owners: Mapping[int, int],
    workers: int,
    rank: int,
    bucket_bytes: int,
    signature: Signature | None = None,
) -> list[ShardedBucket]:
    """``shard="parameters"``: one bucket per unit (``owners``: parameter id -> unit), param group, dtype and
    signature, the later units first (backward reaches them first); the parameters of no unit as ``partition``
    lays them out."""
    buckets = []
    for group_index, group in enumerate(optimizer.param_groups):
        by_unit: dict[tuple[int, Hashable], list[Parameter]] = {}
        rest: list[Parameter] = []
        for parameter in (p for p in group["params"] if p.requires_grad):
            unit = owners.get(id(parameter))
            if unit is None:
                rest.append(parameter)
                continue
            alike = (signature(parameter) if signature is not None else None, parameter.dtype, parameter.device)
            by_unit.setdefault((unit, alike), []).append(parameter)
        for (unit, _), members in sorted(by_unit.items(), key=lambda item: -item[0][0]):
            numel = sum(p.numel() for p in members)
            buckets.append(ShardedBucket(group_index, tuple(members), ShardLayout(numel, workers, rank), unit))
        buckets += [
            ShardedBucket(group_index, bucket.parameters, bucket.layout)
            for bucket in _bucketed(rest, workers, rank, bucket_bytes, signature)
        ]
    return buckets
