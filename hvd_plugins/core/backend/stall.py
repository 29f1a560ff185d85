"""Horovod's stall inspector, set from ``stall_timeout_seconds``: the variables ``hvd.init()`` reads.

A worker that stays alive but never joins a collective leaves the others waiting forever unless
Horovod's stall inspector is told to shut the job down; this module sets that bound.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

STALL_CHECK_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
STALL_SHUTDOWN_ENV = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
STALL_DISABLE_ENV = "HOROVOD_STALL_CHECK_DISABLE"
HOROVOD_DEFAULT_STALL_CHECK_SECONDS = 60


DEFAULT_STALL_TIMEOUT_SECONDS = 1800
"""30 minutes, as torch.distributed's default: far above a checkpoint write or a slow first batch."""


def validate_stall_timeout(seconds: Any, environ: Mapping[str, str] = os.environ) -> int | None:
    """The stall timeout in whole seconds (Horovod reads integers), or None to wait forever.

    ``"auto"`` (the strategy's default) takes horovodrun's ``--stall-check-shutdown-time-seconds``
    (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``) when it was given, waits forever under
    ``--no-stall-check``, and is ``DEFAULT_STALL_TIMEOUT_SECONDS`` otherwise.
    """
    if seconds == "auto":
        if environ.get(STALL_DISABLE_ENV, "0").strip() not in ("", "0"):
            return None
        from_launcher = environ.get(STALL_SHUTDOWN_ENV, "").strip()
        if from_launcher in ("", "0"):
            return DEFAULT_STALL_TIMEOUT_SECONDS
        try:
            return validate_stall_timeout(float(from_launcher))
        except ValueError:
            raise ValueError(
                f"{STALL_SHUTDOWN_ENV}={from_launcher!r} must be a number of seconds >= 1 (or 0 for the default)"
            ) from None
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 1:
        raise ValueError(
            f"stall_timeout_seconds={seconds!r} must be a number of seconds >= 1, 'auto' (horovodrun's "
            f"--stall-check-shutdown-time-seconds, else {DEFAULT_STALL_TIMEOUT_SECONDS} s) or None (wait forever)"
        )
    return math.ceil(seconds)


def stall_environment(timeout_seconds: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The Horovod variables that make a collective missing on some rank end the job after ``timeout_seconds``.

    Horovod ignores a shutdown time shorter than its check interval, so the interval is lowered
    to the timeout when needed (a smaller interval the user set is kept).
    """
    interval = int(environ.get(STALL_CHECK_ENV, HOROVOD_DEFAULT_STALL_CHECK_SECONDS))
    return {STALL_CHECK_ENV: str(max(1, min(interval, timeout_seconds))), STALL_SHUTDOWN_ENV: str(timeout_seconds)}


def apply_stall_timeout(timeout_seconds: int | None, horovod_initialized: bool) -> None:
    """Export the stall variables for Horovod's own stall inspector, which reads them in ``hvd.init()``.

    When a script started Horovod itself, its inspector keeps the settings it started with; the
    bound still holds, because ``CollectiveWatchdog`` enforces it in the package's own waits.
    """
    if timeout_seconds is None or horovod_initialized:
        return
    if os.environ.get(STALL_DISABLE_ENV, "0").strip() not in ("", "0"):
        raise ValueError(
            f"stall_timeout_seconds={timeout_seconds} cannot work while {STALL_DISABLE_ENV}="
            f"{os.environ[STALL_DISABLE_ENV]!r} switches Horovod's stall inspector off; unset one of them"
        )
    os.environ.update(stall_environment(timeout_seconds, os.environ))
