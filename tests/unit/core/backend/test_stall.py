"""The stall timeout: validated, bounded by default, and turned into Horovod's stall variables."""

from __future__ import annotations

import pytest

from hvd_plugins.core.backend.stall import (
    DEFAULT_STALL_TIMEOUT_SECONDS,
    STALL_CHECK_ENV,
    STALL_SHUTDOWN_ENV,
    stall_environment,
    validate_stall_timeout,
)
from hvd_plugins.pytorch.strategies.horovod import HorovodStrategy


def test_stall_timeout_validation() -> None:
    assert validate_stall_timeout(None) is None
    assert validate_stall_timeout(2.5) == 3
    for bad in (0, -1, float("nan"), True, "10"):
        with pytest.raises(ValueError, match="stall_timeout_seconds"):
            validate_stall_timeout(bad)
    with pytest.raises(ValueError, match="stall_timeout_seconds=0"):
        HorovodStrategy(stall_timeout_seconds=0)


def test_stall_environment_keeps_the_check_interval_below_the_timeout() -> None:
    assert stall_environment(20, {}) == {STALL_CHECK_ENV: "20", STALL_SHUTDOWN_ENV: "20"}
    assert stall_environment(120, {}) == {STALL_CHECK_ENV: "60", STALL_SHUTDOWN_ENV: "120"}
    assert stall_environment(120, {STALL_CHECK_ENV: "5"})[STALL_CHECK_ENV] == "5"


def test_the_default_stall_timeout_is_bounded_and_follows_horovodrun() -> None:
    assert validate_stall_timeout("auto", {}) == DEFAULT_STALL_TIMEOUT_SECONDS == 1800
    assert validate_stall_timeout("auto", {STALL_SHUTDOWN_ENV: "120"}) == 120
    assert validate_stall_timeout("auto", {"HOROVOD_STALL_CHECK_DISABLE": "1"}) is None  # --no-stall-check
    with pytest.raises(ValueError, match="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='soon'"):
        validate_stall_timeout("auto", {STALL_SHUTDOWN_ENV: "soon"})
