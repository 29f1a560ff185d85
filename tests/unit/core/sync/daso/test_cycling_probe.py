"""The verdict on cycling, from synthetic step times; ``agree`` stands in for the average over workers."""

from __future__ import annotations

import torch

from hvd_plugins.core.sync.daso.cycling_probe import CYCLING_MARGIN, MIN_TIMED_STEPS, CyclingProbe


def alone(values: torch.Tensor) -> torch.Tensor:
    return values.clone()


def probe_with(synchronous_ms: float, cycling_ms: float, steps: int = 6, agree=alone) -> CyclingProbe:
    """An epoch of synchronous steps, then one of cycling steps, each epoch's first step much slower."""
    probe, now = CyclingProbe(agree), 0.0
    for synchronous, ms in ((True, synchronous_ms), (False, cycling_ms)):
        probe.epoch_started()
        now += 5.0  # the epoch boundary: left out
        probe.step_ended(synchronous, now)
        for _ in range(steps):
            now += ms / 1e3
            probe.step_ended(synchronous, now)
    return probe


def test_cycling_slower_than_the_margin_is_declined_and_the_line_says_by_how_much() -> None:
    probe = probe_with(31.3, 41.7)
    assert not probe.cycling_pays()
    assert probe.measured() == "41.7 ms a cycling step against 31.3 ms a synchronous one (mean over workers)"


def test_cycling_within_the_margin_or_faster_goes_on() -> None:
    assert probe_with(40.0, 40.0 * CYCLING_MARGIN * 0.99).cycling_pays()
    assert probe_with(800.0, 190.0).cycling_pays()  # a slow link: cycling sends a fraction of the bytes


def test_epoch_boundaries_are_not_timed() -> None:
    probe = probe_with(30.0, 30.0)
    assert probe.cycling_pays() and probe.agreed_seconds is not None
    synchronous, cycling = probe.agreed_seconds
    assert abs(synchronous - 0.03) < 1e-9 and abs(cycling - 0.03) < 1e-9  # the 5 s boundaries would show


def test_without_enough_steps_of_both_kinds_cycling_goes_on() -> None:
    assert probe_with(10.0, 500.0, steps=MIN_TIMED_STEPS - 1).cycling_pays()
    no_warmup = CyclingProbe(alone)
    for step in range(10):
        no_warmup.step_ended(False, step * 0.5)
    assert no_warmup.cycling_pays() and no_warmup.measured() == "not compared"


def test_the_verdict_follows_the_agreed_means_not_this_workers_own() -> None:
    def others_much_slower_at_syncing(values: torch.Tensor) -> torch.Tensor:
        return (values + torch.tensor([0.1, 0.0, 1.0], dtype=torch.float64)) / 2  # mean with a worker at 130 ms sync

    probe = probe_with(30.0, 45.0, agree=others_much_slower_at_syncing)
    assert probe.cycling_pays()  # alone, 45 against 30 would stop cycling
