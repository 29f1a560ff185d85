"""An optimizer's parameters, in the order every rank walks them."""

from __future__ import annotations

import torch

from hvd_plugins.core.comm.parameters import indexed_optimizer_parameters, optimizer_parameters


def test_optimizer_parameters_walk_groups_in_order() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (1, 2, 3))
    b.requires_grad_(False)
    optimizer = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
    assert optimizer_parameters(optimizer) == [a, b, c]
    assert optimizer_parameters(optimizer, trainable_only=True) == [a, c]
    assert [(g, i) for g, i, _ in indexed_optimizer_parameters(optimizer)] == [(0, 0), (0, 1), (1, 0)]
