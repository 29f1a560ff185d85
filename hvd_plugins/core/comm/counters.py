"""Communication counters: what this worker handed to collectives, split by the links used."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import Enum


class Scope(str, Enum):
    """Which links a collective uses.

    ``NODE_LOCAL`` collectives stay inside one node; ``CROSS_NODE`` collectives span nodes
    (a flat allreduce over all workers of a multi-node job counts as cross-node).
    """

    NODE_LOCAL = "node_local"
    CROSS_NODE = "cross_node"


@dataclass
class CommCounters:
    """Bytes and tensors this worker handed to Horovod collectives, after compression.

    Bytes are the payload of the tensors submitted (``numel * element_size`` of what goes on
    the wire), not the ring algorithm's traffic, so they can be checked against
    ``parameters x bytes per element x syncs``. ``calls`` counts tensors submitted; Horovod
    may fuse several of them into one transfer. ``wait_seconds`` is time spent blocked
    waiting for collectives to finish. ``copied_bytes`` and ``view_fallbacks`` tell what the
    training thread copied to hand gradients over (``comm.reducer``).
    """

    node_local_bytes: int = 0
    node_local_calls: int = 0
    cross_node_bytes: int = 0
    cross_node_calls: int = 0
    wait_seconds: float = 0.0
    copied_bytes: int = 0
    """Gradient bytes copied on the training thread into buckets and results copied back out of them."""
    view_fallbacks: int = 0
    """Gradients that could not stay views of their bucket (sparse ones, made dense each step)."""

    def record(self, scope: Scope, nbytes: int, calls: int = 1) -> None:
        if scope is Scope.NODE_LOCAL:
            self.node_local_bytes += nbytes
            self.node_local_calls += calls
        else:
            self.cross_node_bytes += nbytes
            self.cross_node_calls += calls

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time a block that waits on collectives."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_seconds += time.perf_counter() - start

    def snapshot(self) -> CommCounters:
        return CommCounters(**asdict(self))

    def since(self, earlier: CommCounters) -> CommCounters:
        """The difference ``self - earlier``: what happened in a window (an epoch, a step)."""
        now, then = asdict(self), asdict(earlier)
        return CommCounters(**{key: now[key] - then[key] for key in now})

    def as_dict(self) -> dict[str, float]:
        return {key: float(value) for key, value in asdict(self).items()}

    def reset(self) -> None:
        for key, value in asdict(CommCounters()).items():
            setattr(self, key, value)
