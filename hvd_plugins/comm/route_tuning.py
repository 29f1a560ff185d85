"""Pick the two-level or the flat route for large gradient buckets by timing both on the first steps.

Which route is faster depends on the link between nodes, not on the model: on a slow link the
two-level allreduce sends half the cross-node bytes of a flat one (2 workers per node) and wins;
on a fast link its three collective rounds lose to flat's one (on 2 nodes x 2 workers over
loopback: 169 ms a step against 68 ms). Nobody should have to know which case they are in, so
``sync="hierarchical"`` times both and keeps the faster. Both routes produce the same sums (up to
float rounding), so the trial steps train as usual.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

TWO_LEVEL, FLAT = "two_level", "flat"
TRIAL_STEPS_PER_ROUTE = 5
"""Timed steps per route before choosing, after one untimed step (Horovod sizes its buffers then)."""

Agree = Callable[[torch.Tensor], torch.Tensor]
"""Averages a small float64 tensor over every worker (``hvd.allreduce``), so all choose alike."""


class RouteTuner:
    """Alternates the routes for the first steps, then keeps the one with the lower step time.

    Every worker times its own steps; the choice compares the mean over workers of each route's
    median, agreed in one small allreduce, so every worker keeps the same route. Every worker
    must call ``record`` once per gradient sync, as the sync itself is collective.
    """

    def __init__(self, agree: Agree, trials_per_route: int = TRIAL_STEPS_PER_ROUTE) -> None:
        if trials_per_route < 1:
            raise ValueError(f"trials_per_route={trials_per_route!r} must be >= 1")
        self._agree = agree
        self._plan = [TWO_LEVEL] + [TWO_LEVEL, FLAT] * trials_per_route
        self._step = 0
        self.seconds: dict[str, list[float]] = {TWO_LEVEL: [], FLAT: []}
        self.choice: str | None = None
        self.agreed_seconds: dict[str, float] = {}
        """The medians compared, averaged over workers (set once the choice is made)."""

    @property
    def route(self) -> str:
        """The route of the next sync."""
        return self.choice or self._plan[self._step]

    def record(self, seconds: float) -> None:
        """Time of the sync that just ran on ``route``; after the last trial, choose."""
        if self.choice is not None:
            return
        if self._step > 0:
            self.seconds[self._plan[self._step]].append(seconds)
        self._step += 1
        if self._step == len(self._plan):
            medians = torch.tensor([statistics.median(self.seconds[r]) for r in (TWO_LEVEL, FLAT)], dtype=torch.float64)
            two_level, flat = (float(v) for v in self._agree(medians))
            self.agreed_seconds = {TWO_LEVEL: two_level, FLAT: flat}
            self.choice = FLAT if flat <= two_level else TWO_LEVEL

    def summary(self) -> str:
        """One line for the log: what was measured and what was chosen."""
        ms = {route: 1e3 * value for route, value in self.agreed_seconds.items()}
        return (
            f"sync='hierarchical': gradient sync took {ms[TWO_LEVEL]:.1f} ms two-level vs {ms[FLAT]:.1f} ms flat "
            f"(median of {len(self.seconds[FLAT])} steps each, mean over workers); large buckets now take the "
            f"{'flat allreduce' if self.choice == FLAT else 'two-level legs'}. Pass flat_below_mb=<MiB> to fix "
            "the route instead."
        )
