"""Slices as storage of their own: read from whole parameters, filled or adopted later, held with no optimizer."""

from __future__ import annotations

import torch

from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.sync.sharded.partition import partition_by_units
from hvd_plugins.core.sync.sharded.slices import BucketSlices, unstepped_slices


def _buckets(model: torch.nn.Module, workers: int = 2, rank: int = 1) -> list:
    owners = {id(p): 0 for p in model.parameters()}
    shapes = {id(p): p.shape for p in model.parameters()}
    return partition_by_units([list(model.parameters())], owners, workers, rank, 2**20, units_only=True, shapes=shapes)


def test_a_worker_keeps_its_slice_of_the_whole_parameters_and_no_optimizer_is_involved() -> None:
    model = torch.nn.Linear(3, 2)  # 6 + 2 elements: worker 1 of 2 holds elements 4..7
    store = BucketSlices(_buckets(model), None, CommCounters(), Scope.NODE_LOCAL, "t")
    assert not isinstance(store, torch.optim.Optimizer)
    flat = torch.cat([model.weight.detach().flatten(), model.bias.detach()])
    (piece,) = store.slices
    assert torch.equal(piece.detach(), flat[4:]) and not store.unfilled(0)
    assert store.parameter_ids() == {id(model.weight), id(model.bias)}


def test_slices_of_parameters_that_hold_shards_wait_to_be_filled_or_adopt_a_slice_without_a_copy() -> None:
    model = torch.nn.Linear(3, 2)
    whole = torch.cat([model.weight.detach().flatten(), model.bias.detach()])
    buckets = _buckets(model)
    with torch.no_grad():
        model.weight.data, model.bias.data = model.weight.data.flatten()[:2].clone(), model.bias.data[:0].clone()
    store = BucketSlices(buckets, None, CommCounters(), Scope.NODE_LOCAL, "t")
    assert store.unfilled(0) and store.slices[0].numel() == 0  # no memory until filled
    given = whole[4:].clone()
    store.adopt_slice(0, given)
    assert store.slices[0].data_ptr() == given.data_ptr() and not store.unfilled(0)

    again = BucketSlices(buckets, None, CommCounters(), Scope.NODE_LOCAL, "t")
    with torch.no_grad():
        model.weight.data, model.bias.data = whole[:6].view(2, 3).clone(), whole[6:].clone()
    again.fill_slice(0, torch.device("cpu"))
    assert torch.equal(again.slices[0].detach(), whole[4:]) and not again.unfilled(0)


def test_unstepped_slices_take_no_gradient_and_release_their_memory() -> None:
    store = unstepped_slices(_buckets(torch.nn.Linear(3, 2)), None, CommCounters(), Scope.NODE_LOCAL)
    assert all(not piece.requires_grad for piece in store.slices)
    store.release_slices()
    assert all(piece.numel() == 0 for piece in store.slices)
