"""Running a training function elastically, the same for the Trainer's fit and a Fabric loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hvd_plugins.core.backend.elastic import ElasticCommits, run_elastic
from hvd_plugins.core.comm.naming import COLLECTIVE_NAMES

T = TypeVar("T")


def run_attempts(
    attempt: Callable[[], T],
    commits: ElasticCommits,
    on_reset: Callable[[], None],
    reset_number: Callable[[], int] | None = None,
) -> T:
    """``attempt()`` until it returns, Horovod started again and ``on_reset`` called after each failure or host change.

    ``reset_number()``: the number the next reset gets in the log (the worker's resets so far, plus one).

    Every attempt starts naming collectives from the first name: workers that just joined meet
    workers that named many collectives before, and Horovod matches collectives by name.
    """

    def named_alike() -> T:
        COLLECTIVE_NAMES.restart()
        return attempt()

    return run_elastic(named_alike, commits, on_reset, reset_number)
