"""How often Horovod's background loop negotiates: chosen before ``hvd.init()``, said once at startup.

Every round of Horovod's loop is a collective of all workers (the response cache's bit vectors are
allreduced). A stock build runs one every ``HOROVOD_CYCLE_TIME`` (1 ms) whether or not anything is
queued, which takes CPU from training all through the forward pass and the optimizer step. The
build of ``hvd-build-horovod`` (patch 0017) sleeps while nothing is queued: an enqueue wakes the
loop at once, and an idle worker still joins a round every ``HOROVOD_IDLE_CYCLE_TIME`` ms so that
shutdowns and stall checks are noticed.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from hvd_plugins.core.backend.build_marker import applied_patches

IDLE_LOOP_PATCH = "0017-idle-loop-sleeps-until-work"
"""The patch of ``hvd-build-horovod``'s build with which the loop sleeps while nothing is queued."""
CYCLE_ENV = "HOROVOD_CYCLE_TIME"
IDLE_ENV = "HOROVOD_IDLE_CYCLE_TIME"
HOROVOD_CYCLE_MS = 1.0
"""Horovod's own default cycle, kept: with the idle loop, 0.2 or 5 ms ran no faster (docs/benchmarks.rst)."""
IDLE_CYCLE_MS = 100.0
"""Rounds of an idle worker: what bounds how late it notices a shutdown; costs no speed (an enqueue wakes it)."""


def choose_loop_cadence(env: MutableMapping[str, str] | None = None, marker: Path | None = None) -> str:
    """Set ``HOROVOD_IDLE_CYCLE_TIME`` in ``env`` (default ``os.environ``) unless the user did, and
    return the startup line that says what the loop will do. ``marker``: the build marker to read."""
    env = os.environ if env is None else env
    cycle = env.get(CYCLE_ENV, f"{HOROVOD_CYCLE_MS:g}")
    if IDLE_LOOP_PATCH not in applied_patches(marker):
        return (
            f"Horovod's loop negotiates every {cycle} ms ({CYCLE_ENV}), work or not: this build lacks "
            f"patch {IDLE_LOOP_PATCH} (hvd-build-horovod builds it)"
        )
    idle = env.setdefault(IDLE_ENV, f"{IDLE_CYCLE_MS:g}")
    try:
        idle_ms = float(idle)
    except ValueError:
        raise ValueError(f"{IDLE_ENV}={idle!r}: give milliseconds as a number (0 negotiates every cycle)") from None
    if idle_ms <= 0:
        return f"Horovod's loop negotiates every {cycle} ms ({CYCLE_ENV}), work or not ({IDLE_ENV}={idle})"
    return (
        f"Horovod's loop negotiates every {cycle} ms while a collective is queued ({CYCLE_ENV}) and every "
        f"{idle} ms while none is ({IDLE_ENV}); an enqueue wakes it at once"
    )
