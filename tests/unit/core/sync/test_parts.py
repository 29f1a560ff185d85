"""Parts of a sharded optimizer's state, one per worker, consolidate into the whole state of the user's optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.partners import PartnerGroup
from hvd_plugins.core.sync.parts import consolidate, consolidate_checkpoint, joined, part_path, parts_marker
from hvd_plugins.core.sync.sharded.optimizer import ShardedOptimizer
from hvd_plugins.core.sync.sharded.partition import partition


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 5)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def worker(optimizer: torch.optim.Optimizer, rank: int, workers: int) -> ShardedOptimizer:
    fresh = torch.optim.AdamW(optimizer.param_groups[0]["params"], lr=0.01)
    buckets = partition(fresh, workers, rank, bucket_bytes=64)
    world = PartnerGroup(tuple(range(workers)), rank, workers)
    return ShardedOptimizer(fresh, buckets, world, CommCounters(), Scope.NODE_LOCAL, "t", True)


def assert_same_state(found: dict, expected: dict) -> None:
    assert found["param_groups"] == expected["param_groups"]
    assert sorted(found["state"]) == sorted(expected["state"])
    for index, values in expected["state"].items():
        assert sorted(found["state"][index]) == sorted(values)
        for key, value in values.items():
            assert torch.equal(found["state"][index][key], value), (index, key)


@pytest.mark.parametrize("workers", [1, 3])
def test_every_workers_part_consolidates_into_the_whole_state(workers: int) -> None:
    _, optimizer = trained()
    whole = optimizer.state_dict()
    parts = []
    for rank in reversed(range(workers)):  # any order
        sharded = worker(optimizer, rank, workers)
        sharded.load_state_dict(whole)
        parts.append(sharded.part())
    assert_same_state(consolidate(parts), whole)
    by_rank = {part["rank"]: part for part in parts}
    again = worker(optimizer, workers - 1, workers)
    again.load_part(by_rank[workers - 1])  # its own part, taken back as saved
    by_rank[workers - 1] = again.part()
    assert_same_state(consolidate(list(by_rank.values())), whole)


def test_a_part_of_another_worker_or_layout_is_refused_and_a_missing_part_is_named(tmp_path: Path) -> None:
    _, optimizer = trained()
    part = worker(optimizer, 0, 3).part()
    with pytest.raises(ValueError, match="saved by worker 0 of 3 with other buckets than worker 1 of 3"):
        worker(optimizer, 1, 3).load_part(part)
    with pytest.raises(ValueError, match="one part from each of the 3 workers"):
        consolidate([part])
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"optimizer_states": parts_marker(3, 1)}, checkpoint)
    torch.save({"optimizer_parts": [part]}, part_path(checkpoint, 0, 3))
    with pytest.raises(FileNotFoundError, match="optimizer-part-1-of-3 is missing"):
        consolidate_checkpoint(checkpoint)


@pytest.mark.parametrize(("start", "count"), [(0, 12), (2, 7), (4, 4), (11, 1), (5, 0)])
def test_a_parameters_elements_are_joined_from_the_workers_pieces_across_their_ends(start: int, count: int) -> None:
    pieces = list(torch.arange(12.0).split(4))
    assert torch.equal(joined(pieces, start, count), torch.arange(12.0)[start : start + count])
