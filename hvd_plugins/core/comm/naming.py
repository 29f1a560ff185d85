"""Names for collectives that stay equal across ranks even after uneven work.

Horovod matches collectives by name, and an unnamed op is named after a per-process handle
counter. When ranks run different numbers of batches (Horovod join), those counters drift
apart and every later unnamed op deadlocks. Ops named here use a sequence that all ranks
reset together at the same point (after the join at the end of each training epoch).
"""

from __future__ import annotations

import itertools


class CollectiveNames:
    """Hands out ``prefix.generation.sequence`` names; ``resync`` starts a new generation."""

    def __init__(self, prefix: str = "hvd_plugins") -> None:
        self.prefix = prefix
        self.generation = 0
        self._sequence = itertools.count()

    def next(self, kind: str) -> str:
        return f"{self.prefix}.{kind}.{self.generation}.{next(self._sequence)}"

    def restart(self) -> None:
        """Start again from the first name, on every rank at the same program point: an elastic reset, where
        workers that just joined meet workers that named many collectives before."""
        self.generation = 0
        self._sequence = itertools.count()

    def resync(self) -> None:
        """Call on every rank at the same program point (all ranks have joined)."""
        self.generation += 1
        self._sequence = itertools.count()


COLLECTIVE_NAMES = CollectiveNames()
