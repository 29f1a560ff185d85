"""RouteTuner: times the two-level and the flat route on the first steps and keeps the faster."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.sync.hierarchical.route_tuning import FLAT, TWO_LEVEL, RouteTuner


def _run_tuner(
    two_level_s: list[float], flat_s: list[float], untimed: tuple[int, ...] = ()
) -> tuple[RouteTuner, list[str], list[torch.Tensor]]:
    """Feeds the tuner the next time of the route it asks for (9 s on the warm-up steps, None on ``untimed``)."""
    agreed: list[torch.Tensor] = []
    tuner = RouteTuner(lambda t: agreed.append(t) or t * 1.0, trials_per_route=3)
    times = {TWO_LEVEL: iter(two_level_s), FLAT: iter(flat_s)}
    routes = []
    for step in range(12):
        routes.append(tuner.route)
        warm_up = step < 2 and step not in untimed
        tuner.record(None if step in untimed else 9.0 if warm_up else next(times[routes[-1]], 0.0))
    return tuner, routes, agreed


def test_route_tuner_warms_each_route_up_then_alternates_and_keeps_the_faster() -> None:
    tuner, routes, agreed = _run_tuner(two_level_s=[0.3, 0.1, 0.3], flat_s=[0.2, 0.2, 0.2])
    assert routes[:8] == [TWO_LEVEL, FLAT, TWO_LEVEL, FLAT, TWO_LEVEL, FLAT, TWO_LEVEL, FLAT]  # 2 untimed first
    assert routes[8:] == [FLAT] * 4 and tuner.choice == FLAT  # medians 0.3 against 0.2
    assert len(agreed) == 2  # after 2 trials each (not clear: 0.1 < 0.2 < 0.3), then after the last
    assert tuner.seconds == {TWO_LEVEL: [0.3, 0.1, 0.3], FLAT: [0.2] * 3}  # the warm-up 9 s steps are not counted
    assert tuner.measured() == "300.0 ms two_level vs 200.0 ms flat (median of 3 steps each, mean over workers)"
    tuner, routes, _ = _run_tuner(two_level_s=[0.1, 0.1, 0.1], flat_s=[0.1, 0.1, 0.1])
    assert tuner.choice == FLAT  # ties keep the flat route


def test_route_tuner_stops_early_when_every_step_of_one_route_beats_the_other() -> None:
    tuner, routes, agreed = _run_tuner(two_level_s=[0.1, 0.12], flat_s=[0.3, 0.25])
    assert routes[6:] == [TWO_LEVEL] * 6 and tuner.choice == TWO_LEVEL
    assert len(agreed) == 1 and tuner.seconds == {TWO_LEVEL: [0.1, 0.12], FLAT: [0.3, 0.25]}


def test_route_tuner_stops_early_when_one_median_is_far_above_the_other() -> None:
    tuner, routes, agreed = _run_tuner(two_level_s=[0.3, 0.05], flat_s=[0.1, 0.1])  # medians 0.175 and 0.1
    assert routes[6:] == [FLAT] * 6 and len(agreed) == 1
    tuner, routes, agreed = _run_tuner(two_level_s=[0.14, 0.14, 0.14], flat_s=[0.1, 0.15, 0.1])  # 1.12x: not clear
    assert len(agreed) == 2 and tuner.choice == FLAT and len(tuner.seconds[FLAT]) == 3


def test_route_tuner_runs_an_untimed_step_again_on_the_same_route() -> None:
    tuner, routes, _ = _run_tuner(two_level_s=[0.3, 0.3], flat_s=[0.1, 0.1], untimed=(2, 3))
    assert routes[:6] == [TWO_LEVEL, FLAT, TWO_LEVEL, TWO_LEVEL, TWO_LEVEL, FLAT]
    assert tuner.choice == FLAT and tuner.seconds == {TWO_LEVEL: [0.3, 0.3], FLAT: [0.1, 0.1]}


def test_route_tuner_refuses_zero_trials() -> None:
    with pytest.raises(ValueError, match="trials_per_route=0 must be >= 1"):
        RouteTuner(lambda t: t, trials_per_route=0)


def test_route_tuner_state_round_trips_so_a_resumed_run_keeps_the_route() -> None:
    tuner, _, _ = _run_tuner(two_level_s=[0.1, 0.1], flat_s=[0.3, 0.3])
    restored = RouteTuner.restored(tuner.state_dict())
    assert restored.choice == TWO_LEVEL and restored.route == TWO_LEVEL
    assert restored.agreed_seconds == tuner.agreed_seconds
    restored.record(5.0)  # decided: nothing is timed or agreed again
    with pytest.raises(ValueError, match="not a route tuner's state"):
        RouteTuner.restored({"routes": ["two_level", "flat"], "choice": "ring", "agreed_seconds": {}})
