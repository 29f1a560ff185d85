"""One line per failing rank, naming the rank, its host and what stopped it."""

from __future__ import annotations

import logging
import socket

from hvd_plugins.core.faults.preemption import TrainingPreempted

log = logging.getLogger(__name__)


def describe_failure(exception: BaseException, rank: int, size: int, local_rank: int, where: str) -> str:
    """One line naming the rank, its host and what stopped it; ranks that only followed a failure say so."""
    kind = type(exception).__name__
    text = str(exception).strip().splitlines()[0] if str(exception).strip() else ""
    cause = f"{kind}: {text}" if text else kind
    if kind == "HorovodInternalError":
        cause = (
            "a collective was aborted because Horovod shut down; another rank failed, was killed, or missed a "
            f"collective for longer than stall_timeout_seconds (look for 'Missing ranks' above). {cause}"
        )
    who = f"rank {rank} of {size} (host {socket.gethostname()}, local rank {local_rank})"
    return f"{who} stopped at {where}: {cause}"


def report_failure(exception: BaseException, rank: int, size: int, local_rank: int, where: str) -> None:
    """Log the failure line at once (stderr), before Lightning's teardown or the launcher's SIGTERM.

    A stop for a time limit or preemption is no failure: rank 0 says what was saved, the others nothing.
    """
    if isinstance(exception, TrainingPreempted):
        if rank == 0:
            log.warning(str(exception))
        return
    log.error(describe_failure(exception, rank, size, local_rank, where))
