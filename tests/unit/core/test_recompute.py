"""Activation checkpointing: the picked modules run their forward again in backward, the gradients are those of
the plain model, the names and state stay, and a policy that picks nothing is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hvd_plugins.core.recompute import checkpoint_activations

pytestmark = pytest.mark.unit


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Counted(), Counted(), nn.Linear(4, 1))


def test_picked_modules_recompute_in_backward_with_the_plain_gradients() -> None:
    plain, checkpointed = _model(), _model()
    assert checkpoint_activations(checkpointed, {Counted}) == ["0", "1"]
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    checkpointed(x).sum().backward()
    assert [m.calls for m in checkpointed[:2]] == [2, 2]  # once in forward, once in backward
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-7)


def test_a_second_setup_does_not_wrap_twice_and_no_grad_runs_once() -> None:
    model = _model()
    checkpoint_activations(model, {Counted})
    assert checkpoint_activations(model, lambda module: isinstance(module, Counted)) == ["0", "1"]
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert [m.calls for m in model[:2]] == [1, 1]
    copy.deepcopy(model)(torch.randn(2, 4)).sum().backward()  # a copy (Lightning's checkpoints) still trains


def test_no_policy_changes_nothing_and_a_policy_that_picks_nothing_is_refused() -> None:
    model = _model()
    assert checkpoint_activations(model, None) == []
    with pytest.raises(ValueError, match=r"activation_checkpointing_policy=.*picks no module of Sequential"):
        checkpoint_activations(model, {nn.Conv2d})
