"""The elastic epoch split: every sample trained once per epoch across resizes, and where an epoch stands."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from torch.utils.data import DistributedSampler

from hvd_plugins.core.elastic.epoch_split import ElasticDistributedSampler, EpochSegments, remaining_after


@pytest.mark.parametrize(
    ("length", "workers", "shuffle", "drop_last"),
    list(itertools.product([12, 13, 31], [1, 2, 3, 4], [True, False], [True, False])),
)
def test_without_a_resize_the_split_is_distributed_samplers(
    length: int, workers: int, shuffle: bool, drop_last: bool
) -> None:
    data = list(range(length))
    for rank in range(workers):
        for epoch in (0, 3):
            theirs = DistributedSampler(data, workers, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            ours = ElasticDistributedSampler(data, workers, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def shares(length: int, workers: int, progress: EpochSegments) -> list[list[int]]:
    return [
        list(ElasticDistributedSampler(range(length), workers, rank, seed=3, progress=progress))
        for rank in range(workers)
    ]


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (4, 3), (3, 1), (2, 6)])
def test_after_a_resize_the_rest_of_the_epoch_is_trained_once(before: int, after: int) -> None:
    """The first ``done`` samples of each old share, then the new shares: every sample once (up to padding)."""
    length, done = 120, 6
    old = shares(length, before, EpochSegments(epoch=2))
    progress = EpochSegments(epoch=2, segments=[(before, done)])
    new = shares(length, after, progress)
    trained = Counter(itertools.chain.from_iterable([share[:done] for share in old] + new))
    assert set(trained) == set(range(length))
    padding = after - 1  # the rest is padded to a multiple of the new number of workers
    assert sum(trained.values()) - length <= padding
    assert len({len(share) for share in new}) == 1, "every worker gets as many samples"


def test_two_resizes_in_one_epoch_still_cover_it() -> None:
    length = 96
    progress = EpochSegments(epoch=0, segments=[(4, 5), (2, 7)])
    before = remaining_after(list(range(length)), [], drop_last=False)
    after_first = remaining_after(before, [(4, 5)], drop_last=False)
    assert len(after_first) == length - 20
    rest = remaining_after(list(range(length)), progress.segments, drop_last=False)
    assert len(rest) == length - 20 - 14


def test_a_resumed_epoch_counts_the_batches_done_before_and_later_epochs_start_whole() -> None:
    progress = EpochSegments(epoch=1, segments=[(4, 8)])
    sampler = ElasticDistributedSampler(range(64), 2, 0, progress=progress, done_before=8)
    sampler.set_epoch(1)
    assert len(list(sampler)) == (64 - 32) // 2
    assert len(sampler) == 8 + (64 - 32) // 2  # Lightning's batch count for the epoch includes the done batches
    sampler.set_epoch(2)
    assert len(list(sampler)) == len(sampler) == 32


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, 2\)"):
        ElasticDistributedSampler(range(8), 2, 2)


def test_where_an_epoch_stands_travels_in_a_commit_as_plain_values() -> None:
    progress = EpochSegments(epoch=3, segments=[(4, 5), (2, 7)])
    plain = progress.as_dict()
    assert plain == {"epoch": 3, "segments": [[4, 5], [2, 7]]}
    assert EpochSegments.from_dict(plain) == progress
    assert EpochSegments.from_dict({}) == EpochSegments()
