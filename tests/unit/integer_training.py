"""Small models and inputs of small integers in float64, for exact comparisons of sums over ranks.

Every gradient of such a model is an integer (and, with a power-of-two learning rate, every update a
short binary fraction), so every order of addition gives the same bits: results can be compared for
equality.
"""

from __future__ import annotations

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
