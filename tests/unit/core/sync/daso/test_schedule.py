"""The DASO schedule as a pure state machine, driven by synthetic loss sequences (no processes).

Expected settings are written from heat's DASO (``heat/optim/dp_optimizer.py``, ``epoch_loss_logic``)
and its ``DetectMetricPlateau`` (``heat/optim/utils.py``), not from this package's code.
"""

from __future__ import annotations

import math

import pytest

from hvd_plugins.core.sync.daso import DasoConfig, DasoSchedule, Phase, StepPlan
from hvd_plugins.core.sync.daso.schedule import improves


def run_epoch(schedule: DasoSchedule, batches: int) -> list[StepPlan]:
    plans = [schedule.on_optimizer_step(last_batch_of_epoch=step == batches - 1) for step in range(batches)]
    schedule.finish_epoch()
    return plans


def settings_sequence(schedule: DasoSchedule, losses: list[float], batches: int = 8) -> list[tuple[str, int, int, int]]:
    """``(phase, global_skips, local_skips, batches_to_wait)`` each epoch ran with."""
    seen = []
    for loss in losses:
        seen.append((schedule.phase.value, *schedule.settings))
        run_epoch(schedule, batches)
        schedule.end_epoch(loss)
    return seen


WARMUP = ("warmup", 1, 1, 0)
COOLDOWN = ("cooldown", 1, 1, 0)


def test_warmup_and_cooldown_communicate_nothing_after_the_step() -> None:
    """Synchronous phases: the gradient average over all workers is the whole sync."""
    schedule = DasoSchedule(DasoConfig(warmup_epochs=2, cooldown_epochs=1), total_epochs=4)
    assert schedule.phase.synchronous
    plans = run_epoch(schedule, 5)
    assert not any(plan.communicates for plan in plans)
    assert not schedule.finish_epoch().communicates
    assert (schedule.phase, schedule.global_skips, schedule.batches_to_wait) == (Phase.WARMUP, 1, 0)
    assert not Phase.CYCLING.synchronous and Phase.COOLDOWN.synchronous


def test_cycling_starts_at_four_skips_one_wait_then_blocks_on_last_batch() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=1), total_epochs=None)
    run_epoch(schedule, 4)
    schedule.end_epoch(1.0)
    # heat: ``warmup_epochs == epoch`` sets (global_skips, local_skips, batches_to_wait) = (4, 1, 1)
    assert (schedule.phase, schedule.settings) == (Phase.CYCLING, (4, 1, 1))
    plans = run_epoch(schedule, 10)
    assert [i + 1 for i, p in enumerate(plans) if p.send] == [4, 8]
    assert [i + 1 for i, p in enumerate(plans) if p.receive] == [5, 9]
    assert all(p.merge_wait == 1 for p in plans if p.receive)
    assert [i + 1 for i, p in enumerate(plans) if p.blocking] == [10]


def test_a_flat_loss_walks_heats_plateau_sequence() -> None:
    """heat's epoch_loss_logic with DetectMetricPlateau(patience=2, threshold=0.05), best from inf.

    heat judges the last warmup epoch's loss first (best = 1.0); each plateau fires when
    num_bad_epochs > patience, i.e. on the 3rd non-improving epoch, and restarts the count.
    On a plateau with gs > 1: gs //= 2, ls //= 2, btw -= 1, then ls and btw raised to 1;
    with gs == 1: reset to (max_gs, max_gs // 4, max_gs // 4) = (8, 2, 2).
    """
    schedule = DasoSchedule(DasoConfig(warmup_epochs=1), total_epochs=None)
    seen = settings_sequence(schedule, [1.0] * 14)
    assert seen == [
        WARMUP,  # its loss (1.0) is the detector's first: best = 1.0
        *[("cycling", 4, 1, 1)] * 3,  # bad epochs 1, 2, 3 -> plateau
        *[("cycling", 2, 1, 1)] * 3,  # btw 1 - 1 = 0 is raised to 1
        *[("cycling", 1, 1, 1)] * 3,  # gs == 1 on a plateau: reset
        *[("cycling", 8, 2, 2)] * 3,
        ("cycling", 4, 1, 1),
    ]


def test_the_last_warmup_loss_is_judged_and_earlier_warmup_losses_are_not() -> None:
    """heat returns before the detector for every warmup epoch but the last one."""
    schedule = DasoSchedule(DasoConfig(warmup_epochs=2), total_epochs=None)
    # A low first-warmup loss would make every later epoch "not improving" if it were judged.
    seen = settings_sequence(schedule, [0.5, 1.0, 0.9, 0.9, 0.9, 0.9, 0.9])
    assert seen == [
        WARMUP,
        WARMUP,  # best = 1.0
        ("cycling", 4, 1, 1),  # 0.9 < 0.95: improves, best = 0.9
        ("cycling", 4, 1, 1),  # bad 1
        ("cycling", 4, 1, 1),  # bad 2
        ("cycling", 4, 1, 1),  # bad 3 > patience: plateau
        ("cycling", 2, 1, 1),
    ]


def test_improvement_is_relative_to_the_best_in_both_signs() -> None:
    # heat's is_better, mode min, rel: a < best * (1 - t) for best >= 0, a < best * (1 + t) otherwise
    assert improves(0.94, 1.0, 0.05) and not improves(0.96, 1.0, 0.05)
    assert improves(-1.06, -1.0, 0.05) and not improves(-1.04, -1.0, 0.05)
    assert improves(123.0, math.inf, 0.05)


def test_improving_loss_keeps_the_skips() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=1, stability_level=0.05), total_epochs=None)
    seen = settings_sequence(schedule, [1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    assert seen == [WARMUP] + [("cycling", 4, 1, 1)] * 5


def test_gs_one_wait_one_keeps_at_most_one_message_in_flight() -> None:
    """(1, 1, 1): every step receives the previous step's message, then sends the next one."""
    schedule = DasoSchedule(DasoConfig(warmup_epochs=0, stable_epochs=0), total_epochs=None)
    for _ in range(3):  # patience 0: (4,1,1) -> best; -> (2,1,1) -> (1,1,1)
        schedule.end_epoch(1.0)
    assert schedule.settings == (1, 1, 1)
    in_flight = 0
    for step in range(1, 7):
        plan = schedule.on_optimizer_step(last_batch_of_epoch=step == 6)
        in_flight -= int(plan.receive)
        assert in_flight == 0  # received before anything new is sent
        in_flight += int(plan.send)
        assert plan.receive == (step > 1) and plan.send == (step < 6) and plan.blocking == (step == 6)
        assert not plan.receive or plan.merge_wait == 1
    assert not schedule.in_flight


def test_message_in_flight_at_epoch_end_is_awaited_before_the_closing_blocking_sync() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=0, stable_epochs=0), total_epochs=None)
    for _ in range(4):  # (4,1,1) best, (2,1,1), (1,1,1), reset (8,2,2)
        schedule.end_epoch(1.0)
    assert schedule.settings == (8, 2, 2)
    plans = run_epoch(schedule, 9)  # send at 8, due at 10: the epoch ends at 9
    assert plans[7].send and not plans[7].receive
    assert plans[8].receive and plans[8].blocking and plans[8].merge_wait == 2
    assert not any(plan.blocking for plan in plans[:8])  # cycling never blocks mid-epoch
    assert not schedule.in_flight


def test_finish_epoch_closes_an_epoch_whose_last_batch_did_not_step() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=0), total_epochs=None)
    for _ in range(4):
        schedule.on_optimizer_step(last_batch_of_epoch=False)  # sent at step 4, still in flight
    assert schedule.in_flight
    owed = schedule.finish_epoch()
    assert owed.receive and owed.blocking
    assert not schedule.finish_epoch().communicates  # nothing owed twice
    schedule.end_epoch(1.0)
    for _ in range(4):
        schedule.on_optimizer_step(last_batch_of_epoch=False)
    with pytest.raises(RuntimeError, match="in flight"):
        schedule.end_epoch(1.0)  # finish_epoch() was skipped


def test_cooldown_is_synchronous_and_not_judged_and_none_means_no_cooldown() -> None:
    config = DasoConfig(warmup_epochs=1, cooldown_epochs=2, stable_epochs=0)
    schedule = DasoSchedule(config, total_epochs=5)
    seen = settings_sequence(schedule, [1.0, 0.5, 0.25, 1.0, 1.0])
    assert seen == [WARMUP, ("cycling", 4, 1, 1), ("cycling", 4, 1, 1), COOLDOWN, COOLDOWN]
    assert schedule.epochs_without_improvement == 0  # heat returns before the detector in cooldown
    endless = DasoSchedule(config, total_epochs=None)
    assert settings_sequence(endless, [1.0] * 30)[-1][0] == "cycling"


def test_warmup_and_cooldown_covering_the_run_leave_no_cycling() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=4, cooldown_epochs=4), total_epochs=6)
    assert [schedule.phase_of(e).value for e in range(6)] == ["warmup"] * 4 + ["cooldown"] * 2


def test_deviations_from_heat_keep_cycling_non_blocking_with_one_message_in_flight() -> None:
    # heat would start at gs 4 > max and reset to (2, 0, 0), blocking; we cap and keep btw >= 1.
    schedule = DasoSchedule(DasoConfig(warmup_epochs=0, max_global_skips=2, stable_epochs=0), total_epochs=None)
    assert schedule.settings == (2, 1, 1)
    # epoch 0 sets best; each later flat epoch is a plateau (patience 0): shrink to 1, reset to max
    assert settings_sequence(schedule, [1.0] * 4) == [("cycling", 2, 1, 1)] * 2 + [
        ("cycling", 1, 1, 1),
        ("cycling", 2, 1, 1),
    ]
    # heat's (32, 16, 16) -> (16, 8, 15) -> (8, 4, 14): btw is capped at gs (one message in flight).
    config = DasoConfig(warmup_epochs=0, max_global_skips=32, local_skip_factor=2, stable_epochs=0)
    schedule = DasoSchedule(config, total_epochs=None)
    seen = settings_sequence(schedule, [1.0] * 8)
    assert seen[4:] == [("cycling", 32, 16, 16), ("cycling", 16, 8, 15), ("cycling", 8, 4, 8), ("cycling", 4, 2, 4)]
    assert all(wait <= skips for _, skips, _, wait in seen)


def test_missing_loss_advances_phases_without_judging() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=1, stable_epochs=0), total_epochs=None)
    seen = settings_sequence(schedule, [float("nan"), float("nan"), float("nan")])
    assert seen == [WARMUP, ("cycling", 4, 1, 1), ("cycling", 4, 1, 1)]
    assert schedule.history[0].loss is None and math.isinf(schedule.best_loss)


def test_state_dict_round_trip_continues_exactly_like_an_uninterrupted_schedule() -> None:
    config = DasoConfig(warmup_epochs=1, cooldown_epochs=1)
    losses = [1.0, 0.9, 0.9, 0.88, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    whole = DasoSchedule(config, total_epochs=len(losses))
    expected = settings_sequence(whole, losses)
    first = DasoSchedule(config, total_epochs=len(losses))
    head = settings_sequence(first, losses[:4])  # stops with two bad epochs counted
    assert first.epochs_without_improvement == 2
    resumed = DasoSchedule(config, total_epochs=len(losses))
    resumed.load_state_dict(first.state_dict())
    assert head + settings_sequence(resumed, losses[4:]) == expected
    assert resumed.history == whole.history
    shorter = DasoSchedule(config, total_epochs=5)  # resumed with fewer epochs: now in cooldown
    shorter.load_state_dict(first.state_dict())
    assert (shorter.phase, shorter.settings) == (Phase.COOLDOWN, (1, 1, 0))


def test_a_fresh_schedule_state_dict_has_no_best_loss_yet() -> None:
    schedule = DasoSchedule(DasoConfig(), total_epochs=None)
    state = schedule.state_dict()
    assert state["best_loss"] is None
    restored = DasoSchedule(DasoConfig(), total_epochs=None)
    restored.load_state_dict(state)
    assert math.isinf(restored.best_loss)


def test_phase_codes_for_loggers() -> None:
    assert [phase.code for phase in Phase] == [0, 1, 2, 3]


def test_declined_cycling_runs_later_cycling_epochs_synchronous_and_survives_a_checkpoint() -> None:
    config = DasoConfig(warmup_epochs=1, cooldown_epochs=1)
    schedule = DasoSchedule(config, total_epochs=5)
    seen = settings_sequence(schedule, [1.0])  # warmup
    run_epoch(schedule, 8)  # the first cycling epoch runs as it was
    assert schedule.phase is Phase.CYCLING
    schedule.decline_cycling()
    schedule.end_epoch(0.9)
    assert not any(plan.communicates for plan in run_epoch(schedule, 8))  # nothing crosses nodes on its own
    schedule.end_epoch(0.8)
    seen += settings_sequence(schedule, [0.7, 0.6])
    assert seen == [("warmup", 1, 1, 0), ("synchronous", 1, 1, 0), ("cooldown", 1, 1, 0)]
    resumed = DasoSchedule(config, total_epochs=6)
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.cycling_declined and resumed.phase_of(4) is Phase.SYNCHRONOUS
    assert resumed.phase_of(5) is Phase.COOLDOWN and resumed.phase_of(0) is Phase.WARMUP
    fresh = DasoSchedule(config, total_epochs=6)
    fresh.load_state_dict({key: value for key, value in schedule.state_dict().items() if key != "cycling_declined"})
    assert not fresh.cycling_declined  # a checkpoint written before the verdict existed
