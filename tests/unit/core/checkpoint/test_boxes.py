"""A flat range of a tensor cut into row-aligned boxes, as DCP stores shards, and a save in one process."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from hvd_plugins.core.checkpoint.boxes import FlatPieces, flat_range_boxes
from hvd_plugins.core.checkpoint.dcp_read import read_dcp
from hvd_plugins.core.checkpoint.dcp_write import SaveFailed, save_dcp
from hvd_plugins.core.comm.shards import LocalShard

pytestmark = pytest.mark.unit

SHAPES = [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (2, 2, 2, 3), ()]


def covered(shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    """How many boxes cover each element of a tensor of ``shape``."""
    counts = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in flat_range_boxes(shape, start, stop):
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        counts[region] += 1
    return counts


@pytest.mark.parametrize("shape", SHAPES)
def test_boxes_cover_exactly_the_flat_range(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        expected = torch.zeros(numel, dtype=torch.int64)
        expected[start:stop] = 1
        assert torch.equal(covered(shape, start, stop).flatten(), expected), (shape, start, stop)


def test_a_range_inside_one_row_is_one_box_and_whole_rows_are_one() -> None:
    assert flat_range_boxes((3, 5), 6, 9) == [((1, 1), (1, 3))]
    assert flat_range_boxes((3, 5), 5, 15) == [((1, 0), (2, 5))]
    assert flat_range_boxes((3, 5), 3, 12) == [((0, 3), (1, 2)), ((1, 0), (1, 5)), ((2, 0), (1, 2))]
    assert flat_range_boxes((3, 5), 4, 4) == []


def test_pieces_give_each_box_its_values_as_views() -> None:
    whole = torch.arange(24.0).reshape(2, 3, 4)
    values = whole.flatten()[5:19]
    pieces = FlatPieces(LocalShard(values, 5, whole.shape))
    for (offsets, sizes), box in pieces.boxes():
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        assert torch.equal(box, whole[region])
        assert box.data_ptr() >= values.data_ptr()  # a view of the shard: no copy
    with pytest.raises(KeyError, match="no box of the tensor at offset"):
        pieces.box_at((1, 2, 3))


def test_a_save_of_pieces_and_tensors_reads_back_whole(tmp_path: Path) -> None:
    whole = torch.arange(15.0).reshape(3, 5)
    state = {"model": {"w": FlatPieces(LocalShard(whole.flatten().clone(), 0, whole.shape)), "b": torch.ones(2)}}
    save_dcp(tmp_path / "ckpt", state, {"epoch": 3}, rank=0, size=1)
    save_dcp(tmp_path / "ckpt", state, {"epoch": 4}, rank=0, size=1)  # a second save replaces the first whole
    read = read_dcp(tmp_path / "ckpt")
    assert torch.equal(read["model"]["w"], whole) and torch.equal(read["model"]["b"], torch.ones(2))
    assert read["epoch"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left beside it


def test_a_failed_save_leaves_the_last_checkpoint(tmp_path: Path) -> None:
    save_dcp(tmp_path / "ckpt", {"model": {"b": torch.ones(2)}}, {"epoch": 1}, rank=0, size=1)
    beyond = FlatPieces(LocalShard(torch.ones(3), 4, torch.Size([5])))  # elements 4 to 6 of 5: DCP refuses it
    with pytest.raises(SaveFailed, match="failed on 1 worker.*rank 0: ValueError"):
        save_dcp(tmp_path / "ckpt", {"model": {"w": beyond}}, {"epoch": 2}, rank=0, size=1)
    assert read_dcp(tmp_path / "ckpt")["epoch"] == 1

