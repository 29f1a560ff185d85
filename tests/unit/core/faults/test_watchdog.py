"""CollectiveWatchdog: a wait in one collective longer than the timeout is reported and ends the worker.

The watchdog ends the process with ``os._exit`` from its thread; here that call is replaced, so only
the thread stops (it blocks there for good) instead of pytest.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from hvd_plugins.core.faults import watchdog as watchdog_module
from hvd_plugins.core.faults.watchdog import STALL_EXIT_CODE, CollectiveWatchdog


class Ended:
    """The exit codes the watchdog asked for, and an event set at the first one."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.event = threading.Event()

    def exit(self, code: int) -> None:
        self.codes.append(code)
        self.event.set()
        threading.Event().wait()  # the watchdog's thread goes no further, as after the real exit


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def ended(monkeypatch: pytest.MonkeyPatch) -> Ended:
    stop = Ended()
    monkeypatch.setattr(watchdog_module, "os", SimpleNamespace(_exit=stop.exit))
    return stop


@pytest.fixture
def messages() -> Iterator[Messages]:
    """What the watchdog logs, read from a handler on its own logger."""
    handler = Messages()
    logger = logging.getLogger(watchdog_module.__name__)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_a_wait_longer_than_the_timeout_is_reported_naming_the_wait_and_ends_the_worker(
    ended: Ended, messages: Messages
) -> None:
    watchdog = CollectiveWatchdog(timeout_seconds=1, rank=3, size=4)
    started = time.monotonic()
    with watchdog.waiting("gradient allreduce"):
        assert ended.event.wait(timeout=20), "the watchdog never ended the worker"
    assert time.monotonic() - started >= 1.0  # not before the timeout
    assert ended.codes == [STALL_EXIT_CODE] == [75]
    (message,) = messages.lines
    assert message.startswith("rank 3 of 4 (host ")
    assert re.search(r"waited \d+ s in the gradient allreduce, longer than stall_timeout_seconds=1", message), message
    assert f"exit code {STALL_EXIT_CODE}" in message


def test_waits_shorter_than_the_timeout_never_end_the_worker_however_many_there_are(
    ended: Ended, messages: Messages
) -> None:
    watchdog = CollectiveWatchdog(timeout_seconds=1, rank=0, size=2)
    for _ in range(3):  # 1.35 s of waiting in all, longer than the timeout, but never 1 s in one wait
        with watchdog.waiting("barrier"):
            time.sleep(0.45)
        time.sleep(0.1)  # between collectives nothing is held
    assert ended.codes == [] and messages.lines == []


def test_after_an_elastic_reset_the_report_names_the_new_rank_and_size(ended: Ended, messages: Messages) -> None:
    watchdog = CollectiveWatchdog(timeout_seconds=1, rank=3, size=4)
    watchdog.follow_world(rank=1, size=2)
    with watchdog.waiting("barrier"):
        assert ended.event.wait(timeout=20), "the watchdog never ended the worker"
    (message,) = messages.lines
    assert message.startswith("rank 1 of 2 (host ") and "in the barrier" in message
