"""Pick the two-level or the flat route for gradients by timing training steps on both, on the first steps.

Which route is faster depends on the link between nodes, not on the model: on a slow link the
two-level allreduce sends half the cross-node bytes of a flat one (2 workers per node) and wins;
on a fast link its three collective rounds lose to flat's one (docs/measurements.rst). Nobody
should have to know which case they are in, so ``sync="hierarchical"`` times both and keeps the
faster. The flat route is Horovod's own: per-gradient allreduces started by backward hooks, which
overlap backward, so whole steps are timed (from one sync's end to the next), not the sync alone.
Both routes produce the same sums (up to float rounding), so the trial steps train as usual.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

TWO_LEVEL, FLAT = "two_level", "flat"
TRIAL_STEPS_PER_ROUTE = 5
"""Most timed steps per route before choosing, after one untimed step of each (Horovod sizes its buffers then)."""
MIN_TRIAL_STEPS_PER_ROUTE = 2
"""Fewest timed steps per route: enough when the result is clear (see ``CLEAR_RATIO``)."""
CLEAR_RATIO = 1.5
"""After the fewest trials, a route whose agreed median is this many times the other's has lost; so has one
whose every step, on every worker, was slower than every step of the other. Otherwise the trials go on."""

Agree = Callable[[torch.Tensor], torch.Tensor]
"""Averages a small float64 tensor over every worker (``hvd.allreduce``), so all choose alike."""


class RouteTuner:
    """Alternates two routes for the first steps, then keeps the one with the lower step time.

    Every worker times its own steps; the choice compares the mean over workers of each route's
    median, agreed in one small allreduce, so every worker keeps the same route. The trials stop
    early, after ``MIN_TRIAL_STEPS_PER_ROUTE`` each, once the result is clear (``CLEAR_RATIO``).
    Every worker must call ``record`` once per sync, as the agreement is collective; a step that
    could not be timed (``None``) is run again on the same route. ``routes[1]`` wins ties.
    """

    def __init__(
        self, agree: Agree, routes: tuple[str, str] = (TWO_LEVEL, FLAT), trials_per_route: int = TRIAL_STEPS_PER_ROUTE
    ) -> None:
        if trials_per_route < 1:
            raise ValueError(f"trials_per_route={trials_per_route!r} must be >= 1")
        self._agree = agree
        self.routes = routes
        self._plan = [*routes] + [*routes] * trials_per_route
        self._min_trials = min(MIN_TRIAL_STEPS_PER_ROUTE, trials_per_route)
        self._step = 0
        self.seconds: dict[str, list[float]] = {route: [] for route in routes}
        self.choice: str | None = None
        self.agreed_seconds: dict[str, float] = {}
        """The medians compared, averaged over workers (set once the choice is made)."""

    @property
    def route(self) -> str:
        """The route of the next sync."""
        return self.choice or self._plan[self._step]

    def record(self, seconds: float | None) -> None:
        """Time of the step that just ran on ``route`` (``None``: not timed); after enough trials, choose."""
        if self.choice is not None:
            return
        warm_up = self._step < len(self.routes)
        if not warm_up:
            if seconds is None:
                return
            self.seconds[self._plan[self._step]].append(seconds)
        self._step += 1
        first, second = (self.seconds[route] for route in self.routes)
        if not warm_up and len(first) == len(second) >= self._min_trials:
            self._choose_if_clear(last=self._step == len(self._plan))

    def _choose_if_clear(self, last: bool) -> None:
        first, second = (self.seconds[route] for route in self.routes)
        medians = [statistics.median(first), statistics.median(second)]
        summary = [*medians, max(first) < min(second), max(second) < min(first)]
        agreed = [float(v) for v in self._agree(torch.tensor(summary, dtype=torch.float64))]
        slower, faster = max(agreed[:2]), min(agreed[:2])
        clear = agreed[2] == 1.0 or agreed[3] == 1.0 or slower >= CLEAR_RATIO * faster
        if not (last or clear):
            return
        self.agreed_seconds = dict(zip(self.routes, agreed[:2], strict=True))
        self.choice = self.routes[1] if agreed[1] <= agreed[0] else self.routes[0]

    def state_dict(self) -> dict[str, Any]:
        """The choice, for checkpoints: a resumed run keeps the route instead of timing both again."""
        return {"routes": list(self.routes), "choice": self.choice, "agreed_seconds": dict(self.agreed_seconds)}

    @staticmethod
    def restored(state: dict[str, Any]) -> RouteTuner:
        """A tuner that already made the choice in ``state`` (it never agrees again)."""

        def already_agreed(medians: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("a restored RouteTuner has made its choice")

        routes = tuple(state["routes"])
        if len(routes) != 2 or state["choice"] not in routes:
            raise ValueError(f"not a route tuner's state: {state!r}")
        tuner = RouteTuner(already_agreed, routes=(routes[0], routes[1]))
        tuner.choice = state["choice"]
        tuner.agreed_seconds = {route: float(value) for route, value in state["agreed_seconds"].items()}
        return tuner

    def measured(self) -> str:
        """What was compared, for a log line: '131.2 ms two_level vs 52.0 ms flat (median of 5 steps each, ...)'."""
        first, second = (f"{1e3 * self.agreed_seconds[route]:.1f} ms {route}" for route in self.routes)
        trials = len(self.seconds[self.routes[1]])
        return f"{first} vs {second} (median of {trials} steps each, mean over workers)"
