"""One flat layout: offsets, views, packing, and each worker's slice, checked against hand-made vectors."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.comm.layout import FlatLayout, flatten, unflatten_into


def tensors() -> list[torch.Tensor]:
    return [torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 7.0), torch.arange(7.0, 11.0).reshape(2, 2)]


def test_offsets_follow_each_other_and_views_are_the_tensors_in_place() -> None:
    layout = FlatLayout.of(tensors(), parts=4)
    assert layout.offsets == (0, 6, 7) and layout.numel == 11 and layout.padded_numel == 12
    flat = torch.arange(12.0)
    views = layout.views(flat)
    assert [view.shape for view in views] == [torch.Size([2, 3]), torch.Size([1]), torch.Size([2, 2])]
    views[2].zero_()
    assert flat[7:11].eq(0).all() and flat[11] == 11  # a view writes into the flat vector, padding untouched
    assert layout.at_views(views, flat) == [True, True, True]
    assert layout.at_views([views[0].clone(), None, views[2]], flat) == [False, False, True]


def test_pack_lays_tensors_end_to_end_zero_for_none_and_zero_padding() -> None:
    given = tensors()
    layout = FlatLayout.of(given, parts=4)
    packed = layout.pack([given[0], None, given[2]], padded=True)
    assert packed.tolist() == [0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 0]
    assert torch.equal(flatten(given), torch.arange(11.0))
    targets = [torch.empty_like(t) for t in given]
    unflatten_into(torch.arange(11.0) * 2, targets)
    assert all(torch.equal(got, 2 * want) for got, want in zip(targets, given, strict=True))


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_the_workers_slices_read_and_write_every_element_once(parts: int) -> None:
    given = tensors()
    whole = torch.cat([t.reshape(-1) for t in given])
    layouts = [FlatLayout.of(given, parts, index) for index in range(parts)]
    slices = [layout.read_slice(given, torch.empty(layout.shard.shard_numel)) for layout in layouts]
    assert torch.equal(torch.cat(slices)[: whole.numel()], whole)
    targets = [torch.full_like(t, -1.0) for t in given]
    for layout, values in zip(layouts, slices, strict=True):
        layout.write_slice(values, targets)
    assert all(torch.equal(got, want) for got, want in zip(targets, given, strict=True))
    gathered = [torch.full_like(t, -1.0) for t in given]
    layouts[0].write_slices(slices, gathered)  # every worker's slice, as an allgather hands them over
    assert all(torch.equal(got, want) for got, want in zip(gathered, given, strict=True))
    covered = [0] * len(given)
    for layout, values in zip(layouts, slices, strict=True):
        for position, part, start in layout.slice_views(values):
            assert torch.equal(part, given[position].reshape(-1)[start : start + part.numel()])
            covered[position] += part.numel()
    assert covered == [t.numel() for t in given]  # every element of every tensor in exactly one slice


def test_an_empty_layout_has_no_offsets_and_nothing_to_pad() -> None:
    layout = FlatLayout([], parts=3, index=2)
    assert layout.offsets == () and layout.numel == 0 and layout.padded_numel == 0 and layout.overlaps() == []
    assert FlatLayout.of(tensors()) == FlatLayout.of([t.clone() for t in tensors()])
