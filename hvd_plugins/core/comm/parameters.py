"""The parameters an optimizer updates, walked in one order.

Collectives over parameters (gradient averaging, DASO's optimizer state, collective names,
agreement checks) must visit them in the same order on every rank: ``param_groups`` order,
then the order inside each group. Every such walk goes through here.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.nn import Parameter
from torch.optim import Optimizer


def indexed_optimizer_parameters(optimizer: Optimizer) -> Iterator[tuple[int, int, Parameter]]:
    """``(group index, position in the group, parameter)`` for every parameter of ``optimizer``.

    For callers that need where a parameter sits (positional collective names, the structure
    the ranks must agree on), not only which parameters there are.
    """
    for group_index, group in enumerate(optimizer.param_groups):
        for position, parameter in enumerate(group["params"]):
            yield group_index, position, parameter


def optimizer_parameters(optimizer: Optimizer, *, trainable_only: bool = False) -> list[Parameter]:
    """Every parameter of ``optimizer`` in group order; with ``trainable_only``, those that require grad."""
    return [p for _, _, p in indexed_optimizer_parameters(optimizer) if p.requires_grad or not trainable_only]
