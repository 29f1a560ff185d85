"""Which samples of an epoch each worker trains when the number of workers changes inside the epoch.

``DistributedSampler`` orders an epoch by seed and epoch, pads (or trims) it to a multiple of the
number of workers and deals it out in turn: worker ``r`` of ``n`` takes positions ``r, r+n, ...``.
After every worker has trained ``c`` samples of its share, exactly the first ``n * c`` positions
of that padded order are done. So where an epoch stands is a list of segments ``(workers, samples
per worker)``; after a resize the samples not yet done, in their original order, are dealt out the
same way over the new workers. Without a resize this is ``DistributedSampler``'s split, sample for
sample. Samples trained after the last commit are rolled back with it and trained again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Sampler


@dataclass
class EpochSegments:
    """How far one epoch got: per segment of constant world size, (workers, samples each had trained)."""

    epoch: int = 0
    segments: list[tuple[int, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """For a commit: plain lists and numbers."""
        return {"epoch": self.epoch, "segments": [list(segment) for segment in self.segments]}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> EpochSegments:
        """From ``as_dict``'s keys (missing ones: epoch 0, no segments)."""
        return cls(int(value.get("epoch", 0)), [(int(n), int(c)) for n, c in value.get("segments", [])])


def epoch_order(length: int, epoch: int, shuffle: bool, seed: int) -> list[int]:
    """The order ``DistributedSampler`` gives the epoch before padding (``seed + epoch`` seeds the shuffle)."""
    if not shuffle:
        return list(range(length))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator).tolist()


def dealt_order(indices: Sequence[int], workers: int, drop_last: bool) -> list[int]:
    """``indices`` padded by repeating from the start, or trimmed with ``drop_last``, to a multiple of ``workers``."""
    if drop_last and len(indices) % workers:
        return list(indices[: (len(indices) // workers) * workers])
    total = math.ceil(len(indices) / workers) * workers
    padded = list(indices)
    while len(padded) < total and indices:
        padded += list(indices[: total - len(padded)])
    return padded


def remaining_after(order: Sequence[int], segments: Sequence[tuple[int, int]], drop_last: bool) -> list[int]:
    """The samples of ``order`` no segment has trained yet, in order."""
    rest = list(order)
    for workers, per_worker in segments:
        done = set(dealt_order(rest, workers, drop_last)[: workers * per_worker])
        rest = [index for index in rest if index not in done]
    return rest


class ElasticDistributedSampler(Sampler[int]):
    """``DistributedSampler`` whose epoch continues over a new number of workers after a resize.

    Its length counts the samples this worker trained before the resize too (``done_before``), so
    Lightning's batch count for the epoch stays right; it yields only the rest. ``set_epoch`` to a
    later epoch starts that epoch whole, dealt over the current workers.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        progress: EpochSegments | None = None,
        done_before: int = 0,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, {num_replicas}) for num_replicas={num_replicas}")
        self.dataset = dataset
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.progress = progress or EpochSegments()
        self.done_before = done_before
        self.epoch = self.progress.epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _resumed(self) -> bool:
        return self.epoch == self.progress.epoch and bool(self.progress.segments)

    def _dealt(self) -> list[int]:
        order = epoch_order(len(self.dataset), self.epoch, self.shuffle, self.seed)
        if self._resumed():
            order = remaining_after(order, self.progress.segments, self.drop_last)
        return dealt_order(order, self.num_replicas, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return iter(self._dealt()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        share = len(self._dealt()) // self.num_replicas
        return share + (self.done_before if self._resumed() else 0)
