"""The epoch cursor both faces keep: segments, samples done, what a commit keeps and what a restore gives back."""

from __future__ import annotations

from collections import Counter

from hvd_plugins.core.elastic.cursor import EpochCursor, committed_world_size
from hvd_plugins.core.elastic.epoch_split import ElasticDistributedSampler


def test_a_fresh_epoch_starts_whole_and_counts_its_samples_by_batch() -> None:
    cursor = EpochCursor()
    assert not cursor.continues(0)
    assert cursor.samples_before(0, batch_size=8) == 0
    cursor.begin_segment(0, batch_size=8, share=30)
    cursor.batches_done += 3
    assert cursor.samples_done() == 24
    cursor.batches_done += 1
    assert cursor.samples_done() == 30, "the last batch is short: no more than the worker's share"


def test_a_commit_keeps_the_segment_under_way_and_a_restore_continues_after_it() -> None:
    cursor = EpochCursor()
    cursor.begin_segment(2, batch_size=4, share=60)
    cursor.batches_done = 5
    state = cursor.commit_state(world_size=4)
    assert state == {"epoch": 2, "segments": [[4, 20]], "world_size": 4, "batches_done": 5}
    assert committed_world_size(state) == 4

    resumed = EpochCursor()
    resumed.restore(state)
    assert resumed.continues(2) and not resumed.continues(3)
    assert resumed.progress().segments == [(4, 20)]
    assert resumed.samples_before(2, batch_size=4) == 20
    resumed.begin_segment(2, batch_size=4, share=40)  # the rest, dealt over a new world
    assert resumed.segment_start == 5
    resumed.batches_done += 2
    assert resumed.samples_done() == 8
    assert resumed.commit_state(world_size=2)["segments"] == [[4, 20], [2, 8]]


def test_the_next_epoch_starts_whole_and_says_whether_the_last_went_on_after_a_reset() -> None:
    cursor = EpochCursor()
    cursor.restore({"epoch": 1, "segments": [[4, 8]], "batches_done": 2})
    assert cursor.next_epoch() is True
    assert (cursor.epoch, cursor.segments, cursor.batches_done, cursor.segment_start) == (2, [], 0, 0)
    assert cursor.next_epoch() is False
    cursor.begin_segment(3, batch_size=8, share=16)
    assert not cursor.continues(3)


def test_a_restore_from_an_empty_commit_is_the_start_of_epoch_zero() -> None:
    cursor = EpochCursor()
    cursor.restore({})
    assert (cursor.epoch, cursor.segments, cursor.batches_done) == (0, [], 0)
    assert committed_world_size({}) == 0


def test_a_shrink_inside_an_epoch_trains_every_sample_once() -> None:
    """Four workers train 3 batches, commit, and two go on from the commit: the cursor and the sampler together
    deal out exactly the samples not yet trained."""
    data, batch_size = list(range(50)), 4
    trained: Counter[int] = Counter()
    cursors = [EpochCursor() for _ in range(4)]
    for rank, cursor in enumerate(cursors):
        sampler = ElasticDistributedSampler(data, 4, rank, shuffle=True, seed=3)
        sampler.set_epoch(0)
        cursor.begin_segment(0, batch_size, len(sampler))
        indices = list(sampler)
        trained.update(indices[: 3 * batch_size])
        cursor.batches_done = 3
    commit = cursors[0].commit_state(world_size=4)

    for rank in range(2):
        cursor = EpochCursor()
        cursor.restore(commit)
        before = cursor.samples_before(0, batch_size)
        sampler = ElasticDistributedSampler(data, 2, rank, True, 3, False, cursor.progress(), before)
        sampler.set_epoch(0)
        cursor.begin_segment(0, batch_size, len(sampler) - before)
        trained.update(sampler)
    assert sorted(trained) == data
    assert set(trained.values()) == {1}
