"""Elastic commits of sharded state on threads standing for workers (``ThreadedJob``): every worker keeps its
part and a copy of one on another host, a new world rebuilds every part from the survivors, and a part that
no survivor holds is reported on every worker alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hvd_plugins.core.comm.topology import Topology, discover_topology
from hvd_plugins.core.sync.sharded import replicas
from hvd_plugins.core.sync.sharded.replicas import (
    LostShardsError,
    holder_ring,
    keeper_of,
    rebuild,
    replicate,
)
from unit.threaded_horovod import RankHorovod, ThreadedJob


def part_of(rank: int) -> dict[str, Any]:
    """A stand-in for a worker's optimizer part: tensors of a size of its own, and its rank."""
    return {"rank": rank, "workers": 4, "state": torch.arange(10 + rank, dtype=torch.float32) * (rank + 1)}


def same_part(got: dict[str, Any], rank: int) -> bool:
    want = part_of(rank)
    return got["rank"] == want["rank"] and torch.equal(got["state"], want["state"])


@pytest.mark.parametrize("round_robin", [False, True], ids=["ranks-by-node", "ranks-alternating"])
def test_every_copy_is_kept_on_another_host(round_robin: bool) -> None:
    job = ThreadedJob(nodes=2, workers_per_node=2, round_robin=round_robin)
    pairs = job.placement
    ring = holder_ring(Topology.from_pairs(0, pairs))
    assert sorted(ring) == [0, 1, 2, 3]
    for rank in range(4):
        assert pairs[keeper_of(rank, ring)][0] != pairs[rank][0], (rank, ring)


def test_one_host_of_two_lost_leaves_every_part_and_a_new_world_rebuilds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    old = ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)

    def commit(hvd: RankHorovod) -> dict[int, torch.Tensor]:
        return replicate(part_of(hvd.rank()), holder_ring(discover_topology()), "opt0.commit")

    held = old.run(commit)
    assert all(len(parts) == 2 and rank in parts for rank, parts in enumerate(held))
    assert sum(part.numel() for parts in held for part in parts.values()) == 2 * sum(
        replicas.to_bytes(part_of(rank)).numel() for rank in range(4)
    ), "each part is kept twice, no more"
    survivors = [held[rank] for rank in (0, 1)]  # node 1 (ranks 2 and 3) left
    new = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)
    rebuilt = new.run(lambda hvd: rebuild(survivors[hvd.rank()], 4, "opt0.rebuild"))
    for parts in rebuilt:
        assert [part["rank"] for part in parts] == [0, 1, 2, 3]
        assert all(same_part(part, rank) for rank, part in enumerate(parts))


def test_two_workers_keeping_the_same_part_lost_together_end_every_worker_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)
    held = old.run(lambda hvd: replicate(part_of(hvd.rank()), holder_ring(discover_topology()), "c"))
    keeper = next(rank for rank in range(4) if 0 in held[rank] and rank != 0)
    survivors = [held[rank] for rank in range(4) if rank not in (0, keeper)]
    new = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)

    def reset(hvd: RankHorovod) -> str:
        with pytest.raises(LostShardsError, match=r"slices of worker\(s\) \[0\] of 4") as error:
            rebuild(survivors[hvd.rank()], 4, "r")
        return str(error.value)

    messages = new.run(reset)
    assert len(set(messages)) == 1 and "last checkpoint on disk" in messages[0]


def test_a_worker_that_joined_holds_nothing_and_still_gets_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    held = {0: replicas.to_bytes(part_of(0)), 1: replicas.to_bytes(part_of(1))}
    job = ThreadedJob(nodes=1, workers_per_node=3).install(monkeypatch)
    rebuilt = job.run(lambda hvd: rebuild(held if hvd.rank() == 2 else {}, 2, "r"))
    assert all(same_part(parts[0], 0) and same_part(parts[1], 1) for parts in rebuilt)
