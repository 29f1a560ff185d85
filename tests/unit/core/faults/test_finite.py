"""FiniteGradientCheck: a NaN/Inf gradient on any rank stops every rank alike, naming the step and the ranks.

Each test is one rank of a two-worker job (FakeHorovod); the other rank's votes are what its
allreduce adds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hvd_plugins.core.faults import finite
from hvd_plugins.core.faults.finite import FiniteGradientCheck, NonFiniteGradientError, require_no_grad_scaler

WHERE = "epoch 0, global step 3"


def averaged(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients a sync mode that shards nothing says this rank owns: all of them."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def backward(model: nn.Module, scale: float = 1.0) -> None:
    (model(torch.ones(4, 3)).sum() * scale).backward()


def other_rank_voted(local: bool, averaged: bool, size: int = 2, rank: int = 1) -> Callable:
    """The other rank's contribution to the vote: ``[local bad per rank..., averaged bad per rank...]``."""

    def votes(tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        theirs = torch.zeros(2 * size)
        theirs[rank], theirs[size + rank] = float(local), float(averaged)
        return theirs

    return votes


def error_of(check: FiniteGradientCheck, optimizer: torch.optim.Optimizer) -> str:
    with pytest.raises(NonFiniteGradientError) as stopped:
        check.after_average(optimizer, averaged(optimizer), WHERE)
    return str(stopped.value)


def test_a_nan_gradient_stops_training_naming_the_step_and_the_rank_it_came_from(fake_horovod) -> None:
    hvd = fake_horovod(finite, size=2, rank=1)
    model, optimizer = model_and_optimizer()
    check = FiniteGradientCheck([optimizer])
    backward(model, scale=math.nan)
    message = error_of(check, optimizer)
    assert message.startswith(
        f"Non-finite gradients at {WHERE}: local gradients were NaN/Inf on rank(s) [1] (of 2 worker(s))."
    ), message
    assert "check_finite_gradients=False turns this check off" in message
    assert hvd.calls == [("allreduce", "hvd_plugins.finite_gradients", hvd.Sum)]  # one vote, summed


def test_a_rank_with_finite_gradients_stops_with_the_same_error_as_the_rank_that_saw_the_nan(fake_horovod) -> None:
    fake_horovod(finite, size=2, rank=1)
    model, optimizer = model_and_optimizer()
    check = FiniteGradientCheck([optimizer])
    backward(model, scale=math.nan)
    on_rank_1 = error_of(check, optimizer)

    fake_horovod(finite, size=2, rank=0, others=other_rank_voted(local=True, averaged=True))
    model, optimizer = model_and_optimizer()
    check = FiniteGradientCheck([optimizer])
    backward(model)
    assert error_of(check, optimizer) == on_rank_1  # no rank is left waiting in a collective


def test_an_average_that_overflows_from_finite_gradients_is_named_as_such(fake_horovod) -> None:
    fake_horovod(finite, size=2, rank=0)
    model, optimizer = model_and_optimizer()
    check = FiniteGradientCheck([optimizer])
    backward(model)
    model.weight.grad[0, 0] = math.inf  # what the average made of finite local gradients
    message = error_of(check, optimizer)
    assert message.startswith(
        f"Non-finite gradients at {WHERE}: local gradients were finite but their average overflowed on rank(s) [0]"
    ), message


def test_finite_steps_pass_and_a_bad_step_is_not_held_against_the_next(fake_horovod) -> None:
    hvd = fake_horovod(finite, size=1)
    model, optimizer = model_and_optimizer()
    check = FiniteGradientCheck([optimizer])
    backward(model)
    check.after_average(optimizer, averaged(optimizer), WHERE)  # finite: nothing raised
    optimizer.zero_grad()
    backward(model, scale=math.inf)
    assert "on rank(s) [0] (of 1 worker(s))" in error_of(check, optimizer)
    optimizer.zero_grad()
    backward(model)
    check.after_average(optimizer, averaged(optimizer), "epoch 0, global step 4")  # the flag was cleared with the vote
    assert hvd.calls == []  # one worker: the vote is its own, no collective


def test_a_removed_check_and_an_optimizer_without_trainable_parameters_watch_nothing(fake_horovod) -> None:
    hvd = fake_horovod(finite, size=2, rank=0)
    model, optimizer = model_and_optimizer()
    frozen = nn.Linear(3, 1).requires_grad_(False)
    idle = torch.optim.SGD(frozen.parameters(), lr=0.1)
    check = FiniteGradientCheck([optimizer, idle])
    check.after_average(idle, averaged(idle), WHERE)
    check.remove()
    backward(model, scale=math.nan)
    check.after_average(optimizer, averaged(optimizer), WHERE)
    assert hvd.calls == []


def test_a_grad_scaler_is_refused_beside_the_check() -> None:
    with pytest.raises(ValueError, match="check_finite_gradients=True cannot be combined with a GradScaler"):
        require_no_grad_scaler(SimpleNamespace(scaler=object()))
    require_no_grad_scaler(SimpleNamespace(scaler=None))
    require_no_grad_scaler(object())
