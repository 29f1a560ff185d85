"""HorovodOptimizerSync and AdasumOptimizerSync: what they hand Horovod's DistributedOptimizer, and when they
wait for it. One rank of a pretend job (FakeHorovod and its DistributedOptimizer)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from hvd_plugins.core.backend import optimizer as backend_optimizer
from hvd_plugins.core.comm import wire, world
from hvd_plugins.core.comm.compression import CountingCompressor, FP16Compression, NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.gradients import gradients_of
from hvd_plugins.core.sync import flat as gradient_sync
from hvd_plugins.core.sync.flat import AdasumOptimizerSync, HorovodOptimizerSync


@pytest.fixture
def hvd(fake_horovod, monkeypatch: pytest.MonkeyPatch):
    """A four-worker job; waiting for started allreduces is recorded instead of polled."""
    fake = fake_horovod(world, wire, backend_optimizer, size=4)
    fake.waited_for = []

    def wait_for_pending_allreduces(optimizer) -> None:
        fake.waited_for.append(optimizer)
        optimizer.events.append("waited")

    monkeypatch.setattr(gradient_sync, "wait_for_pending_allreduces", wait_for_pending_allreduces)
    return fake


def wrapped(sync: HorovodOptimizerSync, model: nn.Module | None = None):
    model = model or nn.Linear(3, 2)
    return sync.wrap(torch.optim.SGD(model.parameters(), lr=0.1), list(model.named_parameters()))


def test_wrap_hands_horovod_the_counting_compressor_op_passes_and_predivide_factor(hvd) -> None:
    counters = CommCounters()
    sync = HorovodOptimizerSync(FP16Compression(), "average", counters, Scope.CROSS_NODE, gradient_predivide_factor=2.0)
    sync.set_backward_passes(torch.optim.SGD([nn.Parameter(torch.zeros(1))]), 3)  # before the wrap: kept for it
    model = nn.Linear(3, 2)
    optimizer = wrapped(sync, model)
    arguments = optimizer.horovod_arguments
    assert arguments["op"] == hvd.Average and arguments["backward_passes_per_step"] == 3
    assert arguments["gradient_predivide_factor"] == 2.0
    assert [name for name, _ in arguments["named_parameters"]] == ["weight", "bias"]
    compression = arguments["compression"]
    assert isinstance(compression, CountingCompressor) and isinstance(compression.inner, FP16Compression)
    compression.compress(torch.zeros(10))
    assert (counters.cross_node_bytes, counters.cross_node_calls, counters.node_local_bytes) == (20, 1, 0)
    summing = HorovodOptimizerSync(NoCompression(), "sum", CommCounters(), Scope.NODE_LOCAL)
    assert wrapped(summing).horovod_arguments["op"] == hvd.Sum


def test_the_step_is_kept_from_synchronizing_and_synchronize_waits_then_completes_it_timed(hvd) -> None:
    counters = CommCounters()
    sync = HorovodOptimizerSync(NoCompression(), "average", counters, Scope.NODE_LOCAL)
    optimizer = wrapped(sync)
    with sync.deferred(optimizer):
        assert optimizer.skipping
    assert not optimizer.skipping
    optimizer.synchronize = lambda: (time.sleep(0.02), optimizer.events.append("synchronize"))
    sync.synchronize(optimizer)
    assert optimizer.events == ["waited", "synchronize"]  # the allreduces in flight first, then Horovod's own
    assert counters.wait_seconds >= 0.02


@pytest.mark.parametrize(("op", "gradient_after"), [("average", 1.0), ("sum", 0.25)])
def test_a_second_backward_settles_the_allreduces_the_first_one_started(hvd, op: str, gradient_after: float) -> None:
    """Accumulating without no_backward_sync: the started allreduces complete before the next backward adds to
    the gradients; with op="sum" the settled sum is divided by the 4 workers, as the step sums once more."""
    sync = HorovodOptimizerSync(NoCompression(), op, CommCounters(), Scope.NODE_LOCAL)
    model = nn.Linear(3, 2)
    optimizer = wrapped(sync, model)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    sync.before_backward(optimizer)  # nothing started yet: nothing to settle
    assert optimizer.events == []
    optimizer.start_allreduces()
    sync.before_backward(optimizer)
    assert optimizer.events == ["waited", "synchronize"]
    assert all(bool((p.grad == gradient_after).all()) for p in model.parameters())


def test_accumulation_reaches_horovods_countdowns_and_teardown_drops_the_hooks(hvd) -> None:
    sync = HorovodOptimizerSync(NoCompression(), "average", CommCounters(), Scope.NODE_LOCAL)
    optimizer = wrapped(sync)
    sync.set_backward_passes(optimizer, 4)
    assert sync.backward_passes == optimizer.backward_passes_per_step == 4
    sync.hold_next_backward(optimizer)  # no_backward_sync: one more backward before each allreduce
    assert set(optimizer._allreduce_delay.values()) == {5}
    sync.teardown([optimizer])
    assert optimizer._grad_accs == []


def test_adasum_steps_inside_the_hooks_so_it_defers_nothing_and_refuses_accumulation_and_clipping(hvd) -> None:
    sync = AdasumOptimizerSync(NoCompression(), "adasum", CommCounters(), Scope.NODE_LOCAL)
    optimizer = wrapped(sync)
    assert optimizer.horovod_arguments["op"] == hvd.Adasum
    with sync.deferred(optimizer):
        assert not optimizer.skipping  # Horovod refuses skip_synchronize for Adasum
    sync.synchronize(optimizer)
    assert optimizer.events == ["waited"]  # step() applies the combined changes
    sync.refuse_unsupported(1, clips_gradients=False)
    with pytest.raises(ValueError, match=r"cannot accumulate gradients \(accumulate_grad_batches=2\)"):
        sync.refuse_unsupported(2, clips_gradients=False)
    with pytest.raises(ValueError, match="op='adasum' cannot clip gradients"):
        sync.refuse_unsupported(1, clips_gradients=True)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=3"):
        sync.set_backward_passes(optimizer, 3)  # an accumulation schedule
    with pytest.raises(ValueError, match=r"\(no_backward_sync\)"):
        sync.hold_next_backward(optimizer)
    sync.before_backward(optimizer)  # nothing started: a first backward is fine
    optimizer.start_allreduces()
    with pytest.raises(ValueError, match="a second backward before the optimizer step"):
        sync.before_backward(optimizer)


def test_gradients_of_zero_fills_trainable_parameters_that_got_no_gradient() -> None:
    used, unused, frozen = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(1))
    frozen.requires_grad_(False)
    used.grad = torch.full((2,), 5.0)
    grads = gradients_of(torch.optim.SGD([used, unused, frozen], lr=0.1))
    assert [g.tolist() for g in grads] == [[5.0, 5.0], [0.0, 0.0, 0.0]]  # every worker hands over the same tensors
    assert unused.grad is grads[1] and frozen.grad is None
