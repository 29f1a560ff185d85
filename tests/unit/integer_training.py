"""Small models and inputs of small integers in float64, for exact comparisons of sums over ranks.

Every gradient of such a model is an integer (and, with a power-of-two learning rate, every update a
short binary fraction), so every order of addition gives the same bits: results can be compared for
equality.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def integer_model(*widths: int) -> nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...`` in float64 with integer weights and biases in [-3, 3]."""
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    model = nn.Sequential(*layers).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randint(-3, 4, parameter.shape, generator=generator))
    return model


def integer_inputs(rank: int, step: int, rows: int, features: int, bound: int) -> torch.Tensor:
    """A rank's inputs at a step: integers in [-bound, bound], the same on every call."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(-bound, bound + 1, (rows, features), generator=generator).double()


def train_synced(
    sync: Any,
    optimizer: Any,
    model: nn.Module,
    batches: Callable[[int], torch.Tensor],
    steps: int,
    before_step: Callable[[int], None] | None = None,
) -> None:
    """``steps`` steps of a gradient sync's loop: the sum of the model's outputs on ``batches(step)`` backward
    through ``sync``, then the wrapped optimizer's step (``before_step(step)`` runs first, where given)."""
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        optimizer.zero_grad()
        sync.before_backward(optimizer)
        model(batches(step)).sum().backward()
        sync.synchronize(optimizer)
        optimizer.step()
