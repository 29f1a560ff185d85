"""Shared by worker scripts: argument parsing, result files, and the registry of named checks.

A worker's checks are plain functions registered in a ``Checks``; each is reported under its
function's name (``key``), and the tests read a report by the function itself (``report_of(report,
check_accumulation)``), so a renamed or mistyped check fails at import, not at the end of a job.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Check = Callable[[], Any]


def parse_out() -> tuple[Path, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", default="")
    args, _ = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out, args


@functools.cache
def out_dir() -> Path:
    """The job's ``--out`` folder, for checks that write files (parsed once, when first asked)."""
    return parse_out()[0]


def write_result(out: Path, rank: int, data: dict[str, Any]) -> None:
    (out / f"rank{rank}.json").write_text(json.dumps(data, default=float))


def listening_addresses(root_pid: int) -> list[str]:
    """``address:port`` of every TCP socket listening in the process tree of ``root_pid`` (the job's sockets)."""
    import psutil

    root = psutil.Process(root_pid)
    found: set[str] = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            continue  # ended meanwhile
        found.update(f"{c.laddr.ip}:{c.laddr.port}" for c in connections if c.status == psutil.CONN_LISTEN)
    return sorted(found)


def key(check: Check) -> str:
    """The name ``check`` is reported under: its function's name."""
    name = getattr(check, "__name__", "")
    if not name.isidentifier():
        raise ValueError(f"{check!r} has no name to report it under; define the check as a named function")
    return name


class Checks:
    """The checks of one job, in the order they run; ``included`` registries first, in the order given.

    Register a check with ``@checks.register`` (``time_limit=`` seconds: a hang in it is reported as
    a failure and the job goes on). Two checks of one job cannot share a name.
    """

    def __init__(self, *included: Checks) -> None:
        self._checks: dict[str, Check] = {}
        self._time_limits: dict[str, float] = {}
        for other in included:
            for name, check in other._checks.items():
                self.register(check, time_limit=other._time_limits.get(name))

    def register(self, check: Check | None = None, *, time_limit: float | None = None) -> Any:
        def add(function: Check) -> Check:
            name = key(function)
            if name in self._checks and self._checks[name] is not function:
                raise ValueError(f"two checks are named {name!r}; a job reports each check under its own name")
            self._checks[name] = function
            if time_limit is not None:
                self._time_limits[name] = time_limit
            return function

        return add(check) if check is not None else add

    def __iter__(self) -> Iterator[Check]:
        return iter(self._checks.values())

    def __len__(self) -> int:
        return len(self._checks)

    def selected(self, case: str) -> Checks:
        """The checks named in ``case`` (comma-separated, as ``case_argument`` writes it), in this order;
        all of them for an empty ``case``."""
        if not case:
            return self
        names = case.split(",")
        unknown = sorted(set(names) - set(self._checks))
        if unknown:
            raise ValueError(f"--case names no check of this job: {unknown}; its checks: {list(self._checks)}")
        chosen = Checks()
        for name, check in self._checks.items():
            if name in names:
                chosen.register(check, time_limit=self._time_limits.get(name))
        return chosen

    def run(self, on_time_limit: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run each check, recording its value or the error, so one failure does not hide the rest.

        Every rank runs every check in the same order; a check that raises on one rank only would
        desynchronize collectives, so checks do their collectives before asserting anything.

        A check with a time limit that is still running after that many seconds (a hang in a
        collective) is recorded as failed, ``on_time_limit`` gets the report so far (to write it), and
        the worker exits with status 0, so the launcher ends the job and the other checks still count.
        """
        report: dict[str, Any] = {}
        for name, check in self._checks.items():
            limit = self._time_limits.get(name)
            timer = None
            if limit is not None:
                timer = threading.Timer(limit, _give_up, args=(report, name, limit, on_time_limit))
                timer.daemon = True
                timer.start()
            start = time.monotonic()
            try:
                report[name] = {"ok": True, "value": check()}
            except Exception as error:  # recorded for pytest to show
                report[name] = {
                    "ok": False,
                    "error": f"{type(error).__name__}: {error}",
                    "trace": traceback.format_exc(),
                }
            finally:
                if timer is not None:
                    timer.cancel()
            report[name]["seconds"] = round(time.monotonic() - start, 3)
        return report


def case_argument(*checks: Check) -> tuple[str, str]:
    """The ``--case`` argument that has a job run only ``checks`` (in the job's own order)."""
    return ("--case", ",".join(key(check) for check in checks))


def report_of(report: dict[str, Any], check: Check) -> Any:
    """What ``check`` returned in one rank's ``report``; fails with the check's own error if it raised."""
    name = key(check)
    assert name in report, f"the job reported no check {name!r}: {sorted(report)}"
    entry = report[name]
    assert entry["ok"], f"check {name!r} failed: {entry['error']}\n{entry['trace']}"
    return entry["value"]


def reports_of(reports: dict[int, dict[str, Any]], check: Check) -> list[Any]:
    """What ``check`` returned on each rank, in rank order."""
    return [report_of(reports[rank], check) for rank in sorted(reports)]


def _give_up(
    report: dict[str, Any], name: str, limit: float, on_time_limit: Callable[[dict[str, Any]], None] | None
) -> None:
    stack = "".join(traceback.format_stack(sys._current_frames()[threading.main_thread().ident]))
    report[name] = {"ok": False, "error": f"Hang: still running after {limit:g} s", "trace": stack}
    if on_time_limit is not None:
        on_time_limit(report)
    sys.stdout.flush()
    os._exit(0)
