"""The fingerprints ranks compare at setup tell different optimizer layouts apart."""

from __future__ import annotations

import torch

from hvd_plugins.core.faults.fingerprints import optimizer_fingerprint


def test_optimizer_fingerprint_sees_count_and_shapes() -> None:
    a, b = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    one = optimizer_fingerprint([torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)])
    two = optimizer_fingerprint([torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)])
    assert one != two and len(two["optimizers"]) == 2
