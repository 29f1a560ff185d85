"""End a worker that waits in one collective for longer than the stall timeout, so no rank hangs forever."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

STALL_EXIT_CODE = 75


class CollectiveWatchdog:
    """End this worker when it has waited in one collective for longer than ``timeout_seconds``.

    Horovod's stall inspector did not fire under the Gloo controller in our runs (no warning, no
    shutdown, with a 3 s check time, after 150 s), so the bound is kept here: a daemon thread
    watches the collective the training loop is waiting in and, past the timeout, reports and
    exits with ``STALL_EXIT_CODE``. horovodrun then terminates the other workers, including the
    stalled one. Exiting from the thread (``os._exit``) is deliberate: the main thread is blocked
    inside Horovod and cannot unwind.
    """

    def __init__(self, timeout_seconds: int, rank: int, size: int) -> None:
        self.timeout_seconds = timeout_seconds
        self._rank, self._size = rank, size
        self._waiting_for: str | None = None
        self._since = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="hvd_plugins-collective-watchdog", daemon=True)
        self._thread.start()

    def follow_world(self, rank: int, size: int) -> None:
        """After an elastic reset: report with this worker's new rank and the new size."""
        self._rank, self._size = rank, size

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Mark the wait for one collective; nothing is held between collectives."""
        with self._lock:
            self._waiting_for, self._since = what, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._waiting_for = None

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_seconds / 4)
        while True:
            time.sleep(interval)
            with self._lock:
                what, waited = self._waiting_for, time.monotonic() - self._since
            if what is not None and waited > self.timeout_seconds:
                log.error(
                    f"rank {self._rank} of {self._size} (host {socket.gethostname()}) waited "
                    f"{waited:.0f} s in the {what}, longer than stall_timeout_seconds={self.timeout_seconds}: some "
                    "rank never joined it (it hangs, or runs different code). Ranks that do not report this are "
                    f"the stalled ones. Ending the job (exit code {STALL_EXIT_CODE})."
                )
                os._exit(STALL_EXIT_CODE)
