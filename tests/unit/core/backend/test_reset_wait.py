"""What a worker says while an elastic reset waits for Horovod's new world, without Horovod."""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest

from hvd_plugins.core.backend.reset_wait import (
    MIN_NP_ENV,
    REPORT_ENV,
    TIMEOUT_ENV,
    WaitPlan,
    wait_saying_so,
    waiting_line,
)

LOG = logging.getLogger("hvd_plugins.test_reset_wait")


def test_the_plan_is_what_horovodrun_told_the_workers() -> None:
    told = WaitPlan.from_env({MIN_NP_ENV: "2", TIMEOUT_ENV: "20", REPORT_ENV: "5"})
    assert told == WaitPlan(min_np=2, timeout_s=20.0, report_s=5.0, told_by_driver=True)
    assert WaitPlan.from_env({}) == WaitPlan()


@pytest.mark.parametrize(("name", "value"), [(MIN_NP_ENV, "two"), (TIMEOUT_ENV, "-3"), (REPORT_ENV, "inf")])
def test_a_malformed_variable_is_named_with_its_value(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        WaitPlan.from_env({name: value})


def test_the_lines_say_how_many_workers_and_how_long_when_told() -> None:
    plan = WaitPlan(min_np=2, timeout_s=20.0, report_s=5.0, told_by_driver=True)
    first = waiting_line(1, 4, plan, 0.0)
    assert first.startswith("elastic reset 1: 4 workers before; waiting for 2 workers (--min-np)")
    assert "(20 s, --elastic-timeout)" in first and "names the hosts" in first
    later = waiting_line(1, 4, plan, 15.2)
    assert "still waiting for 2 workers (--min-np) after 15 s, 5 s left of the elastic timeout of 20 s" in later


def test_under_ray_the_lines_name_the_strategys_settings_and_the_ray_driver() -> None:
    plan = WaitPlan.from_env(
        {"HOROVOD_ELASTIC_MIN_NP": "2", "HOROVOD_ELASTIC_TIMEOUT": "30", "HVD_PLUGINS_ELASTIC_LAUNCHER": "ray"}
    )
    line = waiting_line(1, 4, plan, 0.0)
    assert "waiting for 2 workers (min_workers)" in line and "(30 s, elastic_timeout_s)" in line, line
    assert "the Ray driver's log names the hosts" in line and "horovodrun" not in line, line


def test_without_the_drivers_variables_the_lines_say_what_the_worker_knows() -> None:
    line = waiting_line(2, 3, WaitPlan(), 0.0)
    assert "waiting for the new world (at least --min-np workers)" in line
    assert "600 s unless --elastic-timeout set another" in line and "patch 0016" in line
    assert "left" not in waiting_line(2, 3, WaitPlan(), 31.0)


def test_the_wait_is_reported_at_the_start_and_at_intervals(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)
    plan = WaitPlan(min_np=2, timeout_s=20.0, report_s=0.05, told_by_driver=True)
    wait_saying_so(lambda: time.sleep(0.18), 1, 4, plan, LOG)
    lines = [record.getMessage() for record in caplog.records]
    assert "4 workers before; waiting for 2 workers" in lines[0]
    assert 3 <= len(lines) <= 6 and all("still waiting" in line for line in lines[1:]), lines
    assert not [t for t in threading.enumerate() if t.name == "hvd_plugins-elastic-wait"], "the reporter stopped"


def test_sigterm_takes_its_default_action_only_while_waiting(caplog: pytest.LogCaptureFixture) -> None:
    def handler(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, handler)
    seen: list[object] = []
    try:
        wait_saying_so(lambda: seen.append(signal.getsignal(signal.SIGTERM)), 1, 2, WaitPlan(report_s=60), LOG)
        assert seen == [signal.SIG_DFL]
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_failed_start_is_logged_then_raised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)

    def fail() -> None:
        raise RuntimeError("rendezvous server gone")

    with pytest.raises(RuntimeError, match="rendezvous server gone"):
        wait_saying_so(fail, 3, 2, WaitPlan(report_s=60), LOG)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and errors[0].startswith("elastic reset 3: Horovod did not start again after 0 s")
    assert "rendezvous server gone" in errors[0]
