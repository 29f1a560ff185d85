"""The worked skeleton of a new sync mode in docs/internals.rst builds, trains, and starts its buckets in backward.

The page's Python block is taken as it stands and run here with an in-process stand-in for Horovod,
so the skeleton a new mode starts from cannot drift from the package it builds on.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from doc_pages import DOCS, code_blocks

from hvd_plugins.core.backend import waits
from hvd_plugins.core.comm import world, world_sum

SKELETON_CLASS = "class BucketAverageSync(GradientSync)"


class AsyncFakeHorovod:
    """One of two workers, the other of which always holds three times this worker's tensor; records whether
    each allreduce started inside backward."""

    Sum = "Sum"

    def __init__(self) -> None:
        self.started_in_backward: list[bool] = []

    def size(self) -> int:
        return 2

    def allreduce_async_(self, tensor: torch.Tensor, op: str | None = None, name: str | None = None) -> Any:
        assert op == self.Sum and name is not None
        self.started_in_backward.append(torch._C._current_autograd_node() is not None)
        return tensor.mul_(4)  # this worker's and the other's, summed in place

    def poll(self, handle: Any) -> bool:
        return True

    def synchronize(self, handle: Any) -> torch.Tensor:
        return handle


@pytest.fixture
def skeleton(monkeypatch: pytest.MonkeyPatch) -> tuple[Callable[..., Any], AsyncFakeHorovod]:
    (source,) = [
        block for block in code_blocks((DOCS / "internals.rst").read_text(), "python") if SKELETON_CLASS in block
    ]
    namespace: dict[str, Any] = {}
    exec(compile(source, "docs/internals.rst", "exec"), namespace)
    hvd = AsyncFakeHorovod()
    for module in (world, world_sum, waits):
        monkeypatch.setattr(module, "horovod_torch", lambda: hvd)
    monkeypatch.setattr(waits, "synchronize_sleeps", lambda marker=None: True)
    return namespace["BucketAverageSync"], hvd


def test_the_skeleton_mode_averages_every_bucket_and_starts_them_inside_backward(
    skeleton: tuple[Callable[..., Any], AsyncFakeHorovod],
) -> None:
    mode_class, hvd = skeleton
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    sync = mode_class(bucket_bytes=64)  # several buckets
    optimizer = sync.wrap(torch.optim.SGD(model.parameters(), lr=0.1), list(model.named_parameters()))
    for step in range(2):
        batch = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        alone = copy.deepcopy(model)  # this worker's own gradients: the buckets sum where the gradients lie
        alone(batch).sum().backward()
        local = [p.grad for p in alone.parameters()]
        model.zero_grad()
        model(batch).sum().backward()
        sync.synchronize(optimizer)
        for parameter, own in zip(model.parameters(), local, strict=True):
            assert torch.equal(parameter.grad, (own + 3 * own) / 2)  # the average over the two workers
        optimizer.step()
    buckets = len(sync.reducer(optimizer).buckets.buckets)
    assert buckets > 1 and hvd.started_in_backward == [True] * (2 * buckets)
    sync.teardown([optimizer])
