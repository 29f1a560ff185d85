"""Shared by worker scripts: argument parsing, result files, and a checks runner."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parse_out() -> tuple[Path, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", default="")
    args, _ = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out, args


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


def run_checks(
    checks: dict[str, Callable[[], Any]],
    time_limits: dict[str, float] | None = None,
    on_time_limit: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run each check, recording its value or the error, so one failure does not hide the rest.

    Every rank runs every check in the same order; a check that raises on one rank only would
    desynchronize collectives, so checks do their collectives before asserting anything.

    A check named in ``time_limits`` that is still running after that many seconds (a hang in a
    collective) is recorded as failed, ``on_time_limit`` gets the report so far (to write it), and
    the worker exits with status 0, so the launcher ends the job and the other checks still count.
    """
    report: dict[str, Any] = {}
    for name, check in checks.items():
        limit = (time_limits or {}).get(name)
        timer = None
        if limit is not None:
            timer = threading.Timer(limit, _give_up, args=(report, name, limit, on_time_limit))
            timer.daemon = True
            timer.start()
        start = time.monotonic()
        try:
            report[name] = {"ok": True, "value": check()}
        except Exception as error:  # recorded for pytest to show
            report[name] = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        finally:
            if timer is not None:
                timer.cancel()
        report[name]["seconds"] = round(time.monotonic() - start, 3)
    return report


def _give_up(
    report: dict[str, Any], name: str, limit: float, on_time_limit: Callable[[dict[str, Any]], None] | None
) -> None:
    stack = "".join(traceback.format_stack(sys._current_frames()[threading.main_thread().ident]))
    report[name] = {"ok": False, "error": f"Hang: still running after {limit:g} s", "trace": stack}
    if on_time_limit is not None:
        on_time_limit(report)
    sys.stdout.flush()
    os._exit(0)
