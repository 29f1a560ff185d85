"""The one rule of both faces for the gradient sync at an elastic reset."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from hvd_plugins.core.elastic.reset import sync_after_reset


class FakeSync:
    """A sync mode as the rule sees it: whether the world shapes it, its teardown without collectives, its state."""

    def __init__(self, world_shaped: bool) -> None:
        self.world_shaped = world_shaped
        self.torn_down: list[Sequence[Optimizer]] = []

    def abandon(self, optimizers: Sequence[Optimizer]) -> None:
        self.torn_down.append(optimizers)

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": "as the old world left it"}


def _optimizer_with_allreduces_in_flight(fake_horovod: Callable[..., Any]) -> Any:
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = fake_horovod().DistributedOptimizer(torch.optim.SGD([parameter], lr=0.1), backward_passes_per_step=2)
    optimizer.start_allreduces()
    optimizer._allreduce_delay[parameter] = 0  # counted down by the backward that failed
    return optimizer


def test_a_sync_shaped_by_the_world_is_abandoned_and_dropped_keeping_its_state(fake_horovod) -> None:
    sync, optimizers = FakeSync(world_shaped=True), [_optimizer_with_allreduces_in_flight(fake_horovod)]
    kept, state = sync_after_reset(sync, optimizers)
    assert kept is None
    assert state == {"schedule": "as the old world left it"}
    assert sync.torn_down == [optimizers]


def test_any_other_sync_stays_and_its_optimizers_forget_the_allreduces_in_flight(fake_horovod) -> None:
    sync, optimizer = FakeSync(world_shaped=False), _optimizer_with_allreduces_in_flight(fake_horovod)
    kept, state = sync_after_reset(sync, [optimizer])
    assert kept is sync and state is None
    assert sync.torn_down == []
    assert optimizer._handles == {}
    assert set(optimizer._allreduce_delay.values()) == {2}, "each countdown starts again"


def test_no_sync_yet_stays_none() -> None:
    assert sync_after_reset(None, []) == (None, None)
