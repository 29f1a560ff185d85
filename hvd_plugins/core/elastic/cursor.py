"""Where the epoch under way stands in an elastic job, the same for the Trainer's fit and a Fabric loop.

An epoch trained by several worlds in turn is a list of segments ``(workers, samples each trained)``
(``epoch_split.EpochSegments``). The cursor holds the segments before the one under way and counts
that one in batches; a commit keeps the epoch, its segments with the one under way so far and the
batches done, and after a reset the cursor comes back from it, so that the next world deals out
the rest of the epoch (``epoch_split.ElasticDistributedSampler``). It counts; it trains nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hvd_plugins.core.elastic.epoch_split import EpochSegments


@dataclass
class EpochCursor:
    """The epoch under way: its earlier segments, and the batches and samples of the one under way."""

    epoch: int = 0
    segments: list[tuple[int, int]] = field(default_factory=list)
    """The epoch's segments before the one under way, each ``(workers, samples each worker trained)``."""
    batches_done: int = 0
    """Batches of the epoch this worker has done, over all its segments (a resume counts on from here)."""
    segment_start: int = 0
    """``batches_done`` when the segment under way began."""
    batch_size: int = 0
    """Of the segment under way; 0 when its loader is not one whose epoch can be dealt out again."""
    share: int = 0
    """Samples this worker trains in the segment under way."""

    def continues(self, epoch: int) -> bool:
        """Whether ``epoch`` goes on from a commit taken inside it (restored segments), rather than from its start."""
        return epoch == self.epoch and bool(self.segments)

    def progress(self) -> EpochSegments:
        """The segments the rest of the epoch is dealt out after (for ``ElasticDistributedSampler``)."""
        return EpochSegments(self.epoch, list(self.segments))

    def samples_before(self, epoch: int, batch_size: int) -> int:
        """Samples this worker counts as done in ``epoch`` before its next segment (0 when the epoch starts whole):
        Lightning counts an epoch's batches from its sampler's length, these included."""
        return self.batches_done * batch_size if self.continues(epoch) else 0

    def begin_segment(self, epoch: int, batch_size: int, share: int) -> None:
        """A world starts on ``epoch``: the rest of the epoch under way, or a new epoch from its start."""
        if not self.continues(epoch):
            self.epoch, self.segments, self.batches_done = epoch, [], 0
        self.segment_start = self.batches_done
        self.batch_size, self.share = batch_size, share

    def samples_done(self) -> int:
        """Samples this worker trained in the segment under way (its last batch may be short)."""
        return min((self.batches_done - self.segment_start) * self.batch_size, self.share)

    def commit_state(self, world_size: int) -> dict[str, Any]:
        """What a commit keeps of the epoch: plain numbers and lists, ``restore`` takes them back."""
        segments = [*self.segments, (world_size, self.samples_done())]
        return {
            **EpochSegments(self.epoch, segments).as_dict(),
            "world_size": world_size,
            "batches_done": self.batches_done,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Back to a commit's position (``commit_state``; missing keys: the start of epoch 0)."""
        progress = EpochSegments.from_dict(state)
        self.epoch, self.segments = progress.epoch, progress.segments
        self.batches_done = self.segment_start = int(state.get("batches_done", 0))

    def next_epoch(self) -> bool:
        """The epoch under way ended; the next starts whole. Returns whether the one that ended went on after a
        reset (its loader was built for its rest only)."""
        went_on = bool(self.segments)
        self.epoch, self.segments, self.batches_done, self.segment_start = self.epoch + 1, [], 0, 0
        return went_on


def committed_world_size(state: Mapping[str, Any]) -> int:
    """The number of workers a commit's ``commit_state`` was taken with (0 when unknown)."""
    return int(state.get("world_size", 0))
