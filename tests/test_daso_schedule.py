"""The DASO schedule as a pure state machine, driven by synthetic loss sequences (no processes)."""

from __future__ import annotations

import pytest

from hvd_plugins.daso import DasoConfig, DasoSchedule, Phase, StepPlan


def run_epoch(schedule: DasoSchedule, batches: int) -> list[StepPlan]:
    plans = [schedule.on_optimizer_step(last_batch_of_epoch=step == batches - 1) for step in range(batches)]
    schedule.finish_epoch()
    return plans


def settings_per_epoch(schedule: DasoSchedule, losses: list[float], batches: int = 8) -> list[tuple[str, int, int]]:
    seen = []
    for loss in losses:
        seen.append((schedule.phase.value, schedule.global_skips, schedule.batches_to_wait))
        run_epoch(schedule, batches)
        schedule.end_epoch(loss)
    return seen


def test_warmup_blocks_every_batch() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=2), total_epochs=None)
    plans = run_epoch(schedule, 5)
    assert all(plan.blocking and not plan.send for plan in plans)
    assert (schedule.phase, schedule.global_skips, schedule.batches_to_wait) == (Phase.WARMUP, 1, 0)


def test_cycling_starts_at_four_skips_one_wait_then_blocks_on_last_batch() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=1), total_epochs=None)
    run_epoch(schedule, 4)
    schedule.end_epoch(1.0)
    assert (schedule.phase, schedule.global_skips, schedule.batches_to_wait) == (Phase.CYCLING, 4, 1)
    plans = run_epoch(schedule, 10)
    assert [i + 1 for i, p in enumerate(plans) if p.send] == [4, 8]
    assert [i + 1 for i, p in enumerate(plans) if p.receive] == [5, 9]
    assert all(p.merge_wait == 1 for p in plans if p.receive)
    assert [i + 1 for i, p in enumerate(plans) if p.blocking] == [10]


def test_message_in_flight_at_epoch_end_is_awaited_before_the_closing_blocking_sync() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=0, max_global_skips=8), total_epochs=None)
    schedule.end_epoch(1.0)
    for _ in range(7):  # a flat loss: (4, 1) -> (2, 0) -> (1, 0) -> reset to (8, 2), two epochs each
        schedule.end_epoch(1.0)
    assert (schedule.global_skips, schedule.batches_to_wait) == (8, 2)
    plans = run_epoch(schedule, 9)  # send at 8, due at 10: the epoch ends at 9
    assert plans[7].send and not plans[7].receive
    assert plans[8].receive and plans[8].blocking and plans[8].merge_wait == 2
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


def test_improving_loss_keeps_the_skips() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=1, stability_level=0.05), total_epochs=None)
    seen = settings_per_epoch(schedule, [1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    assert seen == [("warmup", 1, 0)] + [("cycling", 4, 1)] * 5


def test_plateau_shrinks_then_resets_when_global_skips_reach_one() -> None:
    config = DasoConfig(warmup_epochs=1, stable_epochs=2, max_global_skips=8, local_skip_factor=4)
    schedule = DasoSchedule(config, total_epochs=None)
    # improvements smaller than 5 % count as "not improving"
    losses = [1.0, 0.9, 0.89, 0.88, 0.88, 0.88, 0.88, 0.88, 0.88, 0.88, 0.88]
    seen = settings_per_epoch(schedule, losses)
    assert seen == [
        ("warmup", 1, 0),
        ("cycling", 4, 1),  # 0.9 improves on 1.0
        ("cycling", 4, 1),  # 0.89: not improving (1)
        ("cycling", 4, 1),  # 0.88: not improving (2) -> shrink
        ("cycling", 2, 0),
        ("cycling", 2, 0),  # -> shrink
        ("cycling", 1, 0),
        ("cycling", 1, 0),  # gs == 1 and stable -> reset to (max, max // local_skip_factor)
        ("cycling", 8, 2),
        ("cycling", 8, 2),  # -> shrink
        ("cycling", 4, 1),
    ]


def test_cooldown_blocks_for_the_last_epochs_and_none_means_no_cooldown() -> None:
    config = DasoConfig(warmup_epochs=1, cooldown_epochs=2)
    schedule = DasoSchedule(config, total_epochs=5)
    seen = settings_per_epoch(schedule, [1.0, 0.5, 0.25, 0.1, 0.05])
    assert [phase for phase, _, _ in seen] == ["warmup", "cycling", "cycling", "cooldown", "cooldown"]
    assert seen[3:] == [("cooldown", 1, 0)] * 2
    endless = DasoSchedule(config, total_epochs=None)
    assert [phase for phase, _, _ in settings_per_epoch(endless, [1.0] * 30)][-1] == "cycling"


def test_warmup_and_cooldown_covering_the_run_leave_no_cycling() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=4, cooldown_epochs=4), total_epochs=6)
    assert [schedule.phase_of(e).value for e in range(6)] == ["warmup"] * 4 + ["cooldown"] * 2


def test_small_max_global_skips_clip_the_cycle_start_and_wait_stays_below_skips() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=0, max_global_skips=2), total_epochs=None)
    assert (schedule.global_skips, schedule.batches_to_wait) == (2, 1)
    schedule = DasoSchedule(DasoConfig(warmup_epochs=0, max_global_skips=1), total_epochs=None)
    assert (schedule.global_skips, schedule.batches_to_wait) == (1, 0)
    assert all(plan.blocking for plan in run_epoch(schedule, 3))


def test_missing_loss_advances_phases_without_judging() -> None:
    schedule = DasoSchedule(DasoConfig(warmup_epochs=1, stable_epochs=1), total_epochs=None)
    seen = settings_per_epoch(schedule, [float("nan"), float("nan"), float("nan")])
    assert seen == [("warmup", 1, 0), ("cycling", 4, 1), ("cycling", 4, 1)]
    assert schedule.history[0].loss is None


def test_state_dict_round_trip_resumes_where_it_stopped() -> None:
    config = DasoConfig(warmup_epochs=1, stable_epochs=1)
    schedule = DasoSchedule(config, total_epochs=20)
    settings_per_epoch(schedule, [1.0, 1.0, 1.0])
    resumed = DasoSchedule(config, total_epochs=20)
    resumed.load_state_dict(schedule.state_dict())
    assert (resumed.epoch, resumed.phase, resumed.global_skips, resumed.batches_to_wait) == (
        schedule.epoch,
        schedule.phase,
        schedule.global_skips,
        schedule.batches_to_wait,
    )
    assert resumed.history == schedule.history
    shorter = DasoSchedule(config, total_epochs=4)  # resumed with fewer epochs: now in cooldown
    shorter.load_state_dict(schedule.state_dict())
    assert (shorter.phase, shorter.global_skips, shorter.batches_to_wait) == (Phase.COOLDOWN, 1, 0)


def test_phase_codes_for_loggers() -> None:
    assert [phase.code for phase in Phase] == [0, 1, 2]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("warmup_epochs", -1, "warmup_epochs=-1 must be >= 0"),
        ("max_global_skips", 0, "max_global_skips=0 must be >= 1"),
        ("skip_reduction_factor", 1, "skip_reduction_factor=1 must be >= 2"),
        ("stability_level", 1.5, r"stability_level=1.5 must be in \[0, 1\)"),
        ("downcast", "int8", "downcast='int8' is not supported"),
        ("sending_chunk_size", 0, "sending_chunk_size=0 must be >= 1"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DasoConfig(**{field: value})


def test_config_from_dict_names_unknown_settings_and_schedule_rejects_bad_length() -> None:
    with pytest.raises(ValueError, match=r"unknown DASO setting\(s\) \['global_skip'\]"):
        DasoConfig.from_any({"global_skip": 4})
    with pytest.raises(ValueError, match="total_epochs=0 must be >= 1"):
        DasoSchedule(DasoConfig(), total_epochs=0)
