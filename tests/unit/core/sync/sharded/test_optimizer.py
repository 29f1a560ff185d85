"""One worker's ShardedOptimizer steps as the user's optimizer would, and its state round-trips whole."""

from __future__ import annotations

import copy

import pytest
import torch

from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.sync.sharded.optimizer import ShardedOptimizer, refuse_whole_tensor_optimizer
from hvd_plugins.core.sync.sharded.partition import partition


def sharded(optimizer: torch.optim.Optimizer, bucket_bytes: int = 40) -> ShardedOptimizer:
    buckets = partition(optimizer, 1, 0, bucket_bytes)
    return ShardedOptimizer(optimizer, buckets, None, CommCounters(), Scope.NODE_LOCAL, "t", True)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(6, 4, generator=generator)).square().sum().backward()
        optimizer.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.RMSprop(p, lr=0.01),
        lambda p: torch.optim.Adagrad(p, lr=0.1),
    ],
    ids=["sgd", "adam", "adamw", "rmsprop", "adagrad"],
)
def test_one_worker_steps_as_the_unsharded_optimizer_and_saves_its_state_whole(make) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference = copy.deepcopy(model)
    plain = make(reference.parameters())
    wrapped = sharded(make(model.parameters()))
    train(reference, plain, 4)
    train(model, wrapped, 4)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    state, expected = wrapped.state_dict(), plain.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    assert sorted(state["state"]) == sorted(expected["state"])
    for index, values in expected["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=0, atol=1e-6)
    # a fresh sharded optimizer loads the whole state and steps on as the plain one does
    again = sharded(make(model.parameters()))
    again.load_state_dict(expected)
    train(model, again, 2)
    train(reference, plain, 2)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_the_state_lives_on_the_slices_and_a_scheduler_still_sets_the_rate() -> None:
    model = torch.nn.Linear(3, 3)
    wrapped = sharded(torch.optim.Adam(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)
    model(torch.ones(2, 3)).sum().backward()
    wrapped.step()
    scheduler.step()
    assert wrapped.inner is not None and wrapped.inner.state and not wrapped.state
    model(torch.ones(2, 3)).sum().backward()
    wrapped.step()
    assert [group["lr"] for group in wrapped.inner.param_groups] == [0.5]
    moments = 2 * 4 * sum(p.numel() for p in model.parameters())
    assert wrapped.state_bytes() == moments + 4 * len(wrapped.slices)  # two moments, and a step count per slice


@pytest.mark.parametrize("optimizer", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_optimizers_that_need_whole_tensors_are_refused_by_name(optimizer: type) -> None:
    parameters = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=f"cannot shard {optimizer.__name__}: it needs whole parameters"):
        refuse_whole_tensor_optimizer(optimizer(parameters), "gradients")
    marked = torch.optim.SGD(parameters, lr=1.0)
    marked.hvd_plugins_whole_tensors = True  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="cannot shard SGD"):
        refuse_whole_tensor_optimizer(marked, "optimizer")


def test_zero2_refuses_a_grad_scaler_and_zero1_takes_one(fake_horovod) -> None:  # type: ignore[no-untyped-def]
    from hvd_plugins.core.comm import world
    from hvd_plugins.core.comm.compression import NoCompression
    from hvd_plugins.core.sync.sharded import mode

    fake_horovod(world, size=2)
    gradients = mode.ShardedGradientSync("gradients", NoCompression(), "average", CommCounters(), 2**20)
    optimizer = mode.ShardedGradientSync("optimizer", NoCompression(), "average", CommCounters(), 2**20)
    with pytest.raises(ValueError, match="shard='gradients' cannot train with a GradScaler"):
        gradients.refuse_grad_scaler(object())
    gradients.refuse_grad_scaler(None)
    optimizer.refuse_grad_scaler(object())  # keeps the whole gradients the scaler unscales
