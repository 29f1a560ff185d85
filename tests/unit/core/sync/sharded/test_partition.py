"""Buckets per param group and dtype, slices that cover each bucket exactly once over the workers."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.sync.sharded.partition import partition, partition_by_units, trainable_groups


def model_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters()), "lr": 0.5}]
    return model, torch.optim.SGD(groups, lr=0.1)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_the_slices_of_every_worker_cover_each_bucket_once(workers: int) -> None:
    _, optimizer = model_optimizer()
    layouts = [partition(optimizer, workers, rank, bucket_bytes=64) for rank in range(workers)]
    buckets = layouts[0]
    assert [b.group_index for b in buckets] == sorted(b.group_index for b in buckets)
    trainable = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    assert {id(p) for b in buckets for p in b.parameters} == trainable  # frozen bias left out
    for index, bucket in enumerate(buckets):
        flat = torch.cat([p.detach().reshape(-1) for p in bucket.parameters])
        pieces = []
        for rank in range(workers):
            mine = layouts[rank][index]
            assert mine.layout.padded_numel % workers == 0 and mine.layout.padded_numel - flat.numel() < workers
            pieces.append(mine.read_slice([p.detach() for p in mine.parameters], torch.empty(mine.layout.shard_numel)))
        assert torch.equal(torch.cat(pieces)[: flat.numel()], flat)
        targets = [torch.zeros_like(p) for p in bucket.parameters]
        for rank in range(workers):
            layouts[rank][index].write_slice(pieces[rank], targets)
        assert torch.equal(torch.cat([t.reshape(-1) for t in targets]), flat)


def test_frozen_parameters_of_units_get_buckets_of_their_own_and_frozen_ones_of_no_unit_none() -> None:
    first, second, loose = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)
    first.weight.requires_grad_(False)
    loose.weight.requires_grad_(False)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters(), *loose.parameters()], lr=0.1)
    owners = {id(p): 0 for p in first.parameters()} | {id(p): 1 for p in second.parameters()}
    still = [[p for p in group["params"] if not p.requires_grad] for group in optimizer.param_groups]
    frozen = partition_by_units(still, owners, workers=2, rank=1, bucket_bytes=2**20, units_only=True)
    assert [(bucket.unit, bucket.parameters) for bucket in frozen] == [(0, (first.weight,))]
    trainable = partition_by_units(trainable_groups(optimizer), owners, workers=2, rank=1, bucket_bytes=2**20)
    laid_out = {p for bucket in trainable for p in bucket.parameters}
    assert first.weight not in laid_out and loose.weight not in laid_out and loose.bias in laid_out


def test_buckets_never_mix_param_groups_or_dtypes() -> None:
    model = torch.nn.Linear(4, 4)
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = torch.optim.SGD([{"params": [model.weight, extra]}, {"params": [model.bias]}], lr=1.0)
    buckets = partition(optimizer, 2, 0, bucket_bytes=2**20)
    found = sorted((b.group_index, str(p.dtype)) for b in buckets for p in b.parameters[:1])
    assert found == [(0, "torch.float32"), (0, "torch.float64"), (1, "torch.float32")]
    assert all(len({p.dtype for p in b.parameters}) == 1 for b in buckets)


@pytest.mark.parametrize("workers", [1, 3, 4])
def test_every_workers_local_shards_make_each_parameter_whole_and_view_its_slice(workers: int) -> None:
    _, optimizer = model_optimizer()
    layouts = [partition(optimizer, workers, rank, bucket_bytes=64) for rank in range(workers)]
    for index, bucket in enumerate(layouts[0]):
        rebuilt = {id(p): torch.full((p.numel(),), float("nan")) for p in bucket.parameters}
        for rank in range(workers):
            mine = layouts[rank][index]
            slice_values = mine.read_slice([p.detach() for p in mine.parameters], torch.empty(mine.layout.shard_numel))
            for parameter, shard in mine.local_shards(slice_values):
                assert shard.shape == parameter.shape and shard.values.numel() > 0
                assert shard.values.untyped_storage().data_ptr() == slice_values.untyped_storage().data_ptr()  # a view
                rebuilt[id(parameter)][shard.start : shard.start + shard.values.numel()] = shard.values
        for parameter in bucket.parameters:
            assert torch.equal(rebuilt[id(parameter)], parameter.detach().reshape(-1))  # no element missed
