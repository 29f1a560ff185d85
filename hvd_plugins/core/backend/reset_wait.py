"""What a worker says while an elastic reset waits for Horovod's new world, and how a signal ends that wait.

After a failure or a change of hosts every survivor shuts Horovod down and starts it again; the start
returns only once horovodrun's driver has enough usable slots (``--min-np``) for a new world, or never:
a host where a worker failed is blacklisted, and discovery may have removed the others. Meanwhile the
worker would sit silent inside ``hvd.init``. So it says that it waits, for how many workers and how long
horovodrun waits (the elastic timeout), at the start and then at intervals. horovodrun's driver, with
patch 0016 of ``hvd-build-horovod``, says which hosts it waits for and why they are unusable, and tells
the workers ``--min-np`` and the timeout; on another build the worker says what it knows.

The worker waits inside a C++ call, where Python runs no signal handler: while it waits, SIGTERM (from
horovodrun stopping the job) takes its default action and ends the worker at once, instead of leaving it
to SIGKILL.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MIN_NP_ENV = "HOROVOD_ELASTIC_MIN_NP"
"""``--min-np``, which horovodrun with patch 0016 gives its workers."""
TIMEOUT_ENV = "HOROVOD_ELASTIC_TIMEOUT"
"""Seconds horovodrun waits for slots (``--elastic-timeout``): given by horovodrun with patch 0016, and read
by every horovodrun from its environment when the flag is not used."""
REPORT_ENV = "HOROVOD_ELASTIC_WAIT_REPORT_SECONDS"
"""How often the worker and (patch 0016) horovodrun's driver repeat that they wait; 30 s by default."""
DEFAULT_REPORT_S = 30.0
LAUNCHER_ENV = "HVD_PLUGINS_ELASTIC_LAUNCHER"
"""Whose elastic driver the worker waits on: ``horovodrun`` (unset) or ``ray`` (``HorovodRayStrategy``, which
sets it): the wait is told in that launcher's own words."""
WORDS = {
    "horovodrun": {"min": "--min-np", "timeout": "--elastic-timeout", "driver": "horovodrun"},
    "ray": {"min": "min_workers", "timeout": "elastic_timeout_s", "driver": "the Ray driver"},
}
HOROVOD_DEFAULT_TIMEOUT_S = 600
"""horovodrun's elastic timeout without ``--elastic-timeout`` or ``HOROVOD_ELASTIC_TIMEOUT``."""


def _positive(environ: Mapping[str, str], name: str) -> float | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not number > 0 or math.isinf(number):
        raise ValueError(f"{name}={value!r}: expected a positive number of {'workers' if 'NP' in name else 'seconds'}")
    return number


@dataclass(frozen=True)
class WaitPlan:
    """What a worker knows of the wait before it: the workers needed and horovodrun's timeout, if told."""

    min_np: int | None = None
    timeout_s: float | None = None
    report_s: float = DEFAULT_REPORT_S
    told_by_driver: bool = False
    """Whether horovodrun gave ``--min-np`` (a build with patch 0016): its own log then names the hosts."""
    launcher: str = "horovodrun"
    """A key of ``WORDS``: the launcher whose settings the lines name."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WaitPlan:
        """From horovodrun's variables; a malformed one raises ValueError naming it and its value."""
        min_np = _positive(environ, MIN_NP_ENV)
        launcher = environ.get(LAUNCHER_ENV, "horovodrun")
        return cls(
            min_np=int(min_np) if min_np is not None else None,
            timeout_s=_positive(environ, TIMEOUT_ENV),
            report_s=_positive(environ, REPORT_ENV) or DEFAULT_REPORT_S,
            told_by_driver=min_np is not None,
            launcher=launcher if launcher in WORDS else "horovodrun",
        )

    def word(self, what: str) -> str:
        return WORDS[self.launcher][what]

    def workers(self) -> str:
        if self.min_np is None:
            return f"the new world (at least {self.word('min')} workers)"
        return f"{self.min_np} workers ({self.word('min')})"

    def timeout(self) -> str:
        if self.timeout_s is None:
            return f"{HOROVOD_DEFAULT_TIMEOUT_S} s unless {self.word('timeout')} set another"
        return f"{self.timeout_s:.0f} s"

    def where(self) -> str:
        if self.told_by_driver:
            return f"{self.word('driver')}'s log names the hosts it waits for and why they are unusable"
        return f"{self.word('driver')}'s log says more with patch 0016 of hvd-build-horovod"


def waiting_line(number: int, old_size: int, plan: WaitPlan, waited_s: float) -> str:
    """The line a waiting worker logs: at the start (``waited_s`` 0) and then every ``plan.report_s``."""
    if waited_s <= 0:
        return (
            f"elastic reset {number}: {old_size} workers before; waiting for {plan.workers()}; {plan.word('driver')}'s "
            f"elastic timeout ({plan.timeout()}, {plan.word('timeout')}) ends the job without them; {plan.where()}"
        )
    left = f", {max(0.0, plan.timeout_s - waited_s):.0f} s left" if plan.timeout_s is not None else ""
    return (
        f"elastic reset {number}: still waiting for {plan.workers()} after {waited_s:.0f} s{left} "
        f"of the elastic timeout of {plan.timeout()}; {plan.where()}"
    )


def wait_saying_so(start: Callable[[], None], number: int, old_size: int, plan: WaitPlan, log: logging.Logger) -> None:
    """Run ``start()`` (Horovod's shutdown and init) while a thread logs ``waiting_line`` at intervals.

    Called from the main thread, SIGTERM meanwhile ends the process at once (its default action); the
    previous handler is back when ``start()`` returns or raises. A failed start is logged, then raised.
    """
    began = time.monotonic()
    done = threading.Event()

    def report() -> None:
        waited = 0.0  # the first line: the wait begins
        while True:
            log.info(waiting_line(number, old_size, plan, waited))
            if done.wait(plan.report_s):
                return
            waited = time.monotonic() - began

    reporter = threading.Thread(target=report, name="hvd_plugins-elastic-wait", daemon=True)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main else None
    reporter.start()
    try:
        start()
    except BaseException as error:
        waited = time.monotonic() - began
        log.error(f"elastic reset {number}: Horovod did not start again after {waited:.0f} s of waiting: {error}")
        raise
    finally:
        done.set()
        reporter.join()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
