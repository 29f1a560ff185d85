"""EpochEndPolicy: uneven data refused up front for the node-aware syncs; join, resync and buffer averaging
at the end of an epoch for the flat allreduce. One rank of a pretend two-worker job (FakeHorovod)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hvd_plugins.core import epoch_end
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.epoch_end import EpochEndPolicy


def gather_with(other: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An all_gather in which the other rank holds ``other``."""
    return lambda mine: torch.cat([mine, torch.tensor([other], dtype=mine.dtype)])


def never_gathers(mine: torch.Tensor) -> torch.Tensor:
    raise AssertionError("no collective was expected")


@pytest.mark.parametrize("sync", ["hierarchical", "daso"])
def test_node_aware_syncs_refuse_uneven_or_unknown_batch_counts_before_any_rank_hangs(
    fake_horovod,
    sync: str,
) -> None:
    fake_horovod(epoch_end, size=2)
    with pytest.raises(ValueError, match=rf"sync='{sync}' needs the same number of .* ranks have \{{0: 5, 1: 7\}}"):
        EpochEndPolicy(HorovodConfig(sync=sync), gather_with(7)).check_even_batches(5)
    with pytest.raises(ValueError, match=r"the validation data has no length on some rank"):
        EpochEndPolicy(HorovodConfig(sync=sync), gather_with(-1)).check_even_batches(5, "the validation data")
    with pytest.raises(ValueError, match=r"the training data has no length on some rank"):
        EpochEndPolicy(HorovodConfig(sync=sync), gather_with(5)).check_even_batches(float("inf"))
    EpochEndPolicy(HorovodConfig(sync=sync), gather_with(5)).check_even_batches(5)


def test_the_flat_allreduce_and_a_single_worker_take_uneven_data_without_a_collective(fake_horovod) -> None:
    fake_horovod(epoch_end, size=2)
    EpochEndPolicy(HorovodConfig(), never_gathers).check_even_batches(float("inf"))  # Horovod's join handles it
    fake_horovod(epoch_end, size=1)
    EpochEndPolicy(HorovodConfig(sync="daso"), never_gathers).check_even_batches(5)


@pytest.fixture
def resyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The optimizer broadcasts and buffer averages the epoch end asked for."""
    done: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        epoch_end,
        "broadcast_optimizer_state_",
        lambda optimizer, root_rank, name: done.append(("optimizer", root_rank)),
    )
    monkeypatch.setattr(epoch_end, "average_buffers_", lambda model, name: done.append(("buffers",)))
    return done


def test_after_uneven_batches_every_rank_takes_the_state_of_the_rank_that_ran_longest(
    fake_horovod,
    resyncs: list[tuple[Any, ...]],
) -> None:
    hvd = fake_horovod(epoch_end, size=2, rank=0, last_joined=1)
    model = nn.Linear(2, 1)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())]
    EpochEndPolicy(HorovodConfig(), gather_with(12)).finish(model, optimizers, global_step=10)
    assert hvd.calls == [("join",), ("broadcast_parameters", 1)]  # rank 1 joined last: its state wins
    assert resyncs == [("optimizer", 1), ("optimizer", 1), ("buffers",)]


def test_after_even_batches_only_the_buffers_are_averaged(fake_horovod, resyncs: list[tuple[Any, ...]]) -> None:
    hvd = fake_horovod(epoch_end, size=2, rank=0, last_joined=1)
    model = nn.Linear(2, 1)
    EpochEndPolicy(HorovodConfig(), gather_with(10)).finish(model, [], global_step=10)
    assert hvd.calls == [("join",)] and resyncs == [("buffers",)]
    EpochEndPolicy(HorovodConfig(average_buffers=False), gather_with(10)).finish(model, [], global_step=10)
    assert resyncs == [("buffers",)]  # average_buffers=False: not again


def test_node_aware_syncs_join_nothing_and_daso_and_a_single_worker_leave_the_epoch_end_alone(
    fake_horovod,
    resyncs: list[tuple[Any, ...]],
) -> None:
    model = nn.Linear(2, 1)
    hvd = fake_horovod(epoch_end, size=2)
    EpochEndPolicy(HorovodConfig(sync="hierarchical"), never_gathers).finish(model, [], global_step=3)
    assert hvd.calls == [] and resyncs == [("buffers",)]  # no join: even batches were checked up front
    EpochEndPolicy(HorovodConfig(sync="daso"), never_gathers).finish(model, [], global_step=3)
    fake_horovod(epoch_end, size=1)
    EpochEndPolicy(HorovodConfig(), never_gathers).finish(model, [], global_step=3)
    assert hvd.calls == [] and resyncs == [("buffers",)]  # DASO's closing sync did it all; one worker: nothing
