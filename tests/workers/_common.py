"""Shared by worker scripts: argument parsing, result files, and a checks runner."""

from __future__ import annotations

import argparse
import json
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


def run_checks(checks: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each check, recording its value or the error, so one failure does not hide the rest.

    Every rank runs every check in the same order; a check that raises on one rank only would
    desynchronize collectives, so checks do their collectives before asserting anything.
    """
    report: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            report[name] = {"ok": True, "value": check()}
        except Exception as error:  # recorded for pytest to show
            report[name] = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    return report
