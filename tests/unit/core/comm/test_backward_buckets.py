"""Buckets that backward fills: reverse order, ready at the step's last backward pass, armed or not."""

from __future__ import annotations

import torch
from torch import nn

from hvd_plugins.core.comm.backward_buckets import BackwardBuckets


def three_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def backward(model: nn.Module) -> None:
    model(torch.randn(3, 4)).sum().backward()


def test_buckets_hold_parameters_in_reverse_and_start_in_the_order_backward_finishes_them() -> None:
    model = three_layers()
    ready: list[int] = []
    parameters = list(model.parameters())
    buckets = BackwardBuckets(parameters, 300, ready.append)
    assert [p for bucket in buckets.buckets for p in bucket] == parameters[::-1]  # the last layer's bias first
    assert len(buckets.buckets) == 3
    assert buckets.bucket_nbytes() == [sum(p.numel() * 4 for p in bucket) for bucket in buckets.buckets]
    assert all(size <= 300 for size in buckets.bucket_nbytes())
    backward(model)
    assert ready == []  # not armed: the hooks only return
    buckets.armed = True
    backward(model)
    assert ready == [0, 1, 2]  # the output layer's gradients come first
    backward(model)
    assert ready == [0, 1, 2]  # started once a step, until reset
    buckets.reset(passes=1)
    backward(model)
    assert ready == [0, 1, 2, 0, 1, 2]


def test_accumulated_and_held_backward_passes_start_buckets_only_at_the_last_one() -> None:
    model = three_layers()
    ready: list[int] = []
    buckets = BackwardBuckets(list(model.parameters()), 1, ready.append, passes=2)
    buckets.armed = True
    backward(model)
    assert ready == []
    backward(model)
    assert sorted(ready) == list(range(6))  # one bucket per tensor at this size
    buckets.reset(passes=1)
    ready.clear()
    buckets.passes_needed += 1  # a held backward (no_backward_sync)
    backward(model)
    assert ready == []
    backward(model)
    assert len(ready) == 6


def test_a_parameter_without_gradient_keeps_its_bucket_waiting_and_removed_hooks_fire_no_more() -> None:
    model = three_layers()
    ready: list[int] = []
    first = model[0]
    buckets = BackwardBuckets(list(model.parameters()), 10**6, ready.append)  # one bucket
    buckets.armed = True
    first.weight.requires_grad_(False)  # frozen after the buckets were built: no gradient comes
    backward(model)
    assert ready == []
    assert not buckets.matches([p for p in model.parameters() if p.requires_grad])
    first.weight.requires_grad_(True)
    buckets.reset(passes=1)
    buckets.remove()
    backward(model)
    assert ready == [] and not buckets.armed
