"""Whether DASO's cycling pays on this link: cycling steps timed against synchronous ones.

Cycling averages gradients inside the node and sends parameters across nodes every few steps,
downcast: on a slow link it moves a fraction of the bytes and wins by far. On a fast link the
bytes cost little and the collective rounds cost much, and cycling has more of them (the node's
exchange every step, the cross-node sum, the node's gather of it, the epoch's closing sync) than
one fused average over all workers: on two emulated nodes of two workers on loopback, a cycling
step of the benchmarks' MLP took 41.7 ms against 31.3 ms for a warmup step, which averages over
all workers (docs/daso.rst). Nobody should have to know which case they are in, so
``DasoConfig(cycling="auto")`` times both and stops cycling where it does not pay.

Each worker times its steps from one optimizer step's end (its cross-node work included) to the
next; the first step of an epoch is left out, as it carries the epoch boundary. The comparison is
the mean over workers of each kind's mean step, agreed in one small collective, so every worker
decides alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

CYCLING_MARGIN = 1.05
"""Cycling stops when its mean step exceeds the synchronous mean step by more than this factor."""
MIN_TIMED_STEPS = 3
"""Fewest timed steps of each kind to judge from; with fewer, cycling goes on."""

Agree = Callable[[torch.Tensor], torch.Tensor]
"""Averages a small float64 tensor over every worker (``hvd.allreduce``), so all decide alike."""


class CyclingProbe:
    """Step times of synchronous and cycling epochs, and the verdict once a cycling epoch has run."""

    def __init__(self, agree: Agree) -> None:
        self._agree = agree
        self._seconds: dict[bool, list[float]] = {True: [], False: []}  # by "synchronous"
        self._last_step_end: float | None = None
        self.agreed_seconds: tuple[float, float] | None = None
        """(synchronous, cycling) mean step in seconds, mean over workers; set by ``cycling_pays``."""

    def epoch_started(self) -> None:
        """The next step carries the epoch boundary: it is not timed."""
        self._last_step_end = None

    def step_ended(self, synchronous: bool, now: float) -> None:
        """One optimizer step (and what DASO sent or merged after it) ended at ``now`` (seconds)."""
        if self._last_step_end is not None:
            self._seconds[synchronous].append(now - self._last_step_end)
        self._last_step_end = now

    def cycling_pays(self) -> bool:
        """Whether cycling keeps going: a collective, on every worker at the end of the same cycling epoch.

        True when either kind has fewer than ``MIN_TIMED_STEPS`` timed steps on any worker (nothing
        to compare with, e.g. no warmup epoch), or cycling was not ``CYCLING_MARGIN`` times slower.
        """
        synchronous, cycling = self._seconds[True], self._seconds[False]
        enough = float(min(len(synchronous), len(cycling)) >= MIN_TIMED_STEPS)
        means = [statistics.fmean(values) if values else 0.0 for values in (synchronous, cycling)]
        agreed = [float(v) for v in self._agree(torch.tensor([*means, enough], dtype=torch.float64))]
        if agreed[2] < 1.0:  # some worker has too few steps of one kind
            return True
        self.agreed_seconds = (agreed[0], agreed[1])
        return agreed[1] <= CYCLING_MARGIN * agreed[0]

    def measured(self) -> str:
        """For a log line: '41.7 ms a cycling step against 31.3 ms a synchronous one (mean over workers)'."""
        if self.agreed_seconds is None:
            return "not compared"
        synchronous, cycling = self.agreed_seconds
        return (
            f"{1e3 * cycling:.1f} ms a cycling step against {1e3 * synchronous:.1f} ms a synchronous one "
            "(mean over workers)"
        )
