"""Elastic Horovod, the parts that touch Horovod: is this an elastic launch, the commit, the retry loop.

``horovodrun --min-np A --max-np B --host-discovery-script S`` starts workers with
``HOROVOD_ELASTIC=1`` and keeps a driver that starts new workers when hosts appear. A worker whose
peer dies sees ``HorovodInternalError`` from its next collective; a worker told that hosts changed
sees ``HostsUpdatedInterrupt`` at its next commit. Either way Horovod is shut down and started again
(new ranks, new size) and the training function runs again from the last commit. Horovod's own
loop (``horovod.torch.elastic.run``) does this; ``ElasticCommits`` is the state it keeps: one
snapshot in host memory, handed to new workers by a broadcast from rank 0.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.reset_wait import WaitPlan, wait_saying_so

log = logging.getLogger(__name__)

ELASTIC_ENV = "HOROVOD_ELASTIC"
"""Set to ``1`` by horovodrun for every worker of an elastic job (``--host-discovery-script``)."""

T = TypeVar("T")


def elastic_launch(environ: Mapping[str, str] = os.environ) -> bool:
    """True inside a worker that ``horovodrun --host-discovery-script`` started."""
    return environ.get(ELASTIC_ENV) == "1"


class ElasticCommits:
    """The elastic job's last commit: one snapshot (a dict in host memory), kept by Horovod's ``ObjectState``.

    ``commit(snapshot)`` keeps it, then checks for host changes with one broadcast from rank 0, so
    every worker raises ``HostsUpdatedInterrupt`` at the same commit. After a failed collective
    Horovod's loop puts the last committed snapshot back; before each attempt it gives every worker
    rank 0's, so a worker that just joined starts where the others are. Snapshots must be copies:
    training goes on changing the tensors they were taken from.
    """

    def __init__(self) -> None:
        from horovod.common.elastic import ObjectState

        hvd = horovod_torch()
        self.state = ObjectState(bcast_object=_broadcast, get_rank=hvd.rank, snapshot=None)

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The snapshot the next attempt starts from (None before the first commit)."""
        return self.state.snapshot

    def commit(self, snapshot: dict[str, Any]) -> None:
        self.state.snapshot = snapshot
        self.state.commit()  # may raise HostsUpdatedInterrupt, after keeping the snapshot


def _broadcast(value: Any, root_rank: int = 0) -> Any:
    """``value`` as rank ``root_rank`` holds it. The host check of every commit sends three integers: one tensor
    broadcast for them instead of ``broadcast_object``'s two (its size, then its pickle); the rest is pickled."""
    hvd = horovod_torch()
    if isinstance(value, tuple) and len(value) == 3 and all(isinstance(item, int) for item in value):
        sent = hvd.broadcast(torch.tensor(value, dtype=torch.int64), root_rank, name="hvd_plugins.elastic.hosts")
        return tuple(int(item) for item in sent)
    return hvd.broadcast_object(value, root_rank, name="hvd_plugins.elastic.commit")


def run_elastic(
    attempt: Callable[[], T],
    commits: ElasticCommits,
    on_reset: Callable[[], None],
    reset_number: Callable[[], int] | None = None,
) -> T:
    """Run ``attempt()`` until it returns, starting Horovod again and calling ``on_reset`` after each failure
    of a peer or change of hosts (Horovod's own elastic loop, with its shutdown-and-init reset).

    While Horovod starts again the worker says that it waits, for how many workers and how long
    (``reset_wait``); ``reset_number()`` numbers the reset as ``on_reset`` will (1, 2... by default).
    """
    from horovod.common.elastic import run_fn

    hvd = horovod_torch()
    plan = WaitPlan.from_env()  # a malformed variable fails the fit before it starts, not at its first reset
    resets = 0

    def start_again() -> None:
        nonlocal resets
        resets += 1
        old_size = hvd.size() if hvd.is_initialized() else 0

        def restart() -> None:
            hvd.shutdown()
            hvd.init()

        number = reset_number() if reset_number is not None else resets
        wait_saying_so(restart, number, old_size, plan, log)

    commits.state.register_reset_callbacks([on_reset])
    return run_fn(lambda _state: attempt(), start_again)(commits.state)
