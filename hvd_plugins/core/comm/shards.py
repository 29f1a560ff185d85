"""One shard layout: how a flat vector splits into equal shards, the last one zero-padded, and whose is which.

A reduce-scatter hands member ``i`` of a group shard ``i`` of the sum; DASO carries shard ``i`` of the
parameters across nodes from local worker ``i``; a sharded optimizer steps shard ``i`` on worker ``i``.
All of them pad and split the same way, here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardLayout:
    """A flat vector of ``numel`` elements in ``parts`` equal shards of ``shard_numel``; this worker owns ``index``."""

    numel: int
    parts: int
    index: int = 0

    def __post_init__(self) -> None:
        if self.parts < 1 or not 0 <= self.index < self.parts or self.numel < 0:
            raise ValueError(f"not a shard layout: numel={self.numel}, parts={self.parts}, index={self.index}")

    @property
    def shard_numel(self) -> int:
        return math.ceil(self.numel / self.parts) if self.numel else 0

    @property
    def padded_numel(self) -> int:
        """The vector's length once padded to ``parts`` whole shards."""
        return self.shard_numel * self.parts

    @property
    def start(self) -> int:
        """Where this worker's shard begins in the padded vector."""
        return self.index * self.shard_numel

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` zero-padded to ``padded_numel`` (``flat`` itself when it splits evenly)."""
        padding = self.padded_numel - flat.numel()
        return torch.cat([flat, flat.new_zeros(padding)]) if padding else flat

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """A copy of this worker's shard of ``flat``, zero-padded to ``shard_numel``."""
        piece = flat[self.start : self.start + self.shard_numel]
        padding = self.shard_numel - piece.numel()
        return torch.cat([piece, piece.new_zeros(padding)]) if padding else piece.clone()


@dataclass(frozen=True)
class LocalShard:
    """This worker's part of one parameter: ``values`` (1-D) are elements ``start`` to ``start + values.numel()``
    of the parameter flattened, whose whole shape is ``shape``. Every worker's parts together make it whole."""

    values: torch.Tensor
    start: int
    shape: torch.Size
