"""The whole-world queries and blocking collectives a sync mode uses, on a job of two nodes of two workers
(``ThreadedJob``: every rank a thread of this process)."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.comm.world import (
    average_over_world,
    gather_over_world,
    max_over_world,
    send_one_way,
    spans_nodes,
    sum_over_world,
    world_group,
    world_rank,
    world_size,
)
from unit.threaded_horovod import RankHorovod, ThreadedJob


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> ThreadedJob:
    return ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)


def test_this_worker_and_the_world_are_horovods_rank_size_and_nodes(job: ThreadedJob) -> None:
    found = job.run(lambda hvd: (world_rank(), world_size(), spans_nodes(), world_group().ranks))
    assert found == [(rank, 4, True, (0, 1, 2, 3)) for rank in range(4)]


def test_sum_average_and_max_combine_every_workers_tensor(job: ThreadedJob) -> None:
    def combine(hvd: RankHorovod) -> tuple[list[float], ...]:
        mine = torch.tensor([float(hvd.rank()), 10.0 - hvd.rank()])
        results = (sum_over_world(mine, "s"), average_over_world(mine, "a"), max_over_world(mine, "m"))
        assert mine.tolist() == [float(hvd.rank()), 10.0 - hvd.rank()]  # left as it was
        return tuple(result.tolist() for result in results)

    assert job.run(combine) == [([6.0, 34.0], [1.5, 8.5], [3.0, 10.0])] * 4


def test_a_gather_concatenates_rows_of_any_count_in_rank_order(job: ThreadedJob) -> None:
    gathered = job.run(lambda hvd: gather_over_world(torch.full((hvd.rank(),), hvd.rank()), "g").tolist())
    assert gathered == [[1, 2, 2, 3, 3, 3]] * 4


def test_sending_one_way_around_a_ring_gives_each_worker_the_previous_ones_tensor(job: ThreadedJob) -> None:
    def pass_on(hvd: RankHorovod) -> list[int]:
        return send_one_way(torch.full((hvd.rank() + 1,), hvd.rank()), (hvd.rank() + 1) % 4, "ring").tolist()

    assert job.run(pass_on) == [[3, 3, 3, 3], [0], [1, 1], [2, 2, 2]]


def test_a_job_of_one_worker_needs_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    alone = ThreadedJob(nodes=1, workers_per_node=1).install(monkeypatch)

    def by_itself(hvd: RankHorovod) -> bool:
        tensor = torch.ones(3)
        same = [sum_over_world(tensor, "s"), average_over_world(tensor, "a"), max_over_world(tensor, "m")]
        return all(result is tensor for result in same) and gather_over_world(tensor, "g") is tensor

    assert alone.run(by_itself) == [True]
    assert alone.pending() == {}
