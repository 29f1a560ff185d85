"""SyncGuards: the gradient average runs inside the watchdog's bounded wait, then the NaN/Inf check sees it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.faults import finite
from hvd_plugins.core.faults.finite import FiniteGradientCheck
from hvd_plugins.core.sync import guards as sync_guards
from hvd_plugins.core.sync.guards import SyncGuards


class RecordingWatchdog:
    """Stands in for CollectiveWatchdog: notes its settings and which wait is open."""

    def __init__(self, timeout_seconds: int, rank: int, size: int) -> None:
        self.settings = (timeout_seconds, rank, size)
        self.open: str | None = None

    def follow_world(self, rank: int, size: int) -> None:
        self.settings = (self.settings[0], rank, size)

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        self.open = what
        try:
            yield
        finally:
            self.open = None


@pytest.fixture
def watchdogs(monkeypatch: pytest.MonkeyPatch) -> list[RecordingWatchdog]:
    made: list[RecordingWatchdog] = []

    def make(*args: Any) -> RecordingWatchdog:
        made.append(RecordingWatchdog(*args))
        return made[-1]

    monkeypatch.setattr(sync_guards, "CollectiveWatchdog", make)
    return made


def test_one_watchdog_per_process_with_a_stall_timeout_and_none_without(watchdogs: list[RecordingWatchdog]) -> None:
    unbounded = SyncGuards(HorovodConfig(stall_timeout_seconds=None))
    unbounded.start_watching(rank=0, size=2)
    assert unbounded.watchdog is None and watchdogs == []
    with unbounded.waiting("barrier"):  # waits, unbounded
        pass
    guards = SyncGuards(HorovodConfig(stall_timeout_seconds=30))
    guards.start_watching(rank=1, size=4)
    guards.start_watching(rank=1, size=4)  # a second fit in the process
    (watchdog,) = watchdogs
    assert guards.watchdog is watchdog and watchdog.settings == (30, 1, 4)
    guards.follow_world(rank=0, size=3)  # an elastic reset
    assert watchdog.settings == (30, 0, 3)
    with guards.waiting("barrier"):
        assert watchdog.open == "barrier"


def test_the_average_and_the_finite_check_run_inside_the_bounded_wait_in_that_order(
    watchdogs: list[RecordingWatchdog],
) -> None:
    guards = SyncGuards(HorovodConfig(stall_timeout_seconds=30))
    guards.start_watching(rank=0, size=2)
    (watchdog,) = watchdogs
    seen: list[tuple[str, str | None]] = []
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sync = SimpleNamespace(
        synchronize=lambda opt: seen.append(("synchronize", watchdog.open)), owned_gradients=lambda opt: []
    )
    guards.after_backward(sync, optimizer, where=lambda: pytest.fail("asked where without a finite check"))
    guards.after_backward(sync, optimizer, where=lambda: pytest.fail("averaged twice for one backward"))
    guards.average_for_step(sync, optimizer, where=lambda: pytest.fail("averaged twice for one backward"))
    guards.finite_check = SimpleNamespace(after_average=lambda opt, owned, where: seen.append((where, watchdog.open)))
    guards.after_backward(sync, optimizer, where=lambda: "epoch 1, global step 7")
    assert seen == [
        ("synchronize", "gradient allreduce"),
        ("synchronize", "gradient allreduce"),
        ("epoch 1, global step 7", "gradient allreduce"),
    ]
    assert watchdog.open is None


def test_the_finite_check_follows_the_setting_refuses_a_grad_scaler_and_replaces_the_last_fits(
    fake_horovod,
) -> None:
    fake_horovod(finite, size=1)
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    off = SyncGuards(HorovodConfig())
    off.check_gradients_of([optimizer], precision_plugin=object())
    assert off.finite_check is None
    guards = SyncGuards(HorovodConfig(check_finite_gradients=True))
    with pytest.raises(ValueError, match="cannot be combined with a GradScaler"):
        guards.check_gradients_of([optimizer], precision_plugin=SimpleNamespace(scaler=object()))
    guards.check_gradients_of([optimizer], precision_plugin=object())
    first = guards.finite_check
    assert isinstance(first, FiniteGradientCheck) and len(first._handles) == 2  # a hook per parameter
    guards.check_gradients_of([optimizer], precision_plugin=object())  # the next fit
    assert guards.finite_check is not first and first._handles == []  # the earlier hooks are gone
    guards.stop_checking()
    assert guards.finite_check is None
