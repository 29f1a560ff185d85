"""Dated benchmark reports: every written table opens with when, on what and by which command it was made.

A committed report then stays readable after the code moves on (its header says which machine and
versions produced it and how to make it again), so no measured number needs to live in a script.
Only the standard library is used: versions are read from the installed packages' metadata.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

VERSIONED = (("torch", "torch"), ("Lightning", "lightning"), ("Horovod", "horovod"))


def docs_dir(script: str | Path) -> Path:
    """``docs/benchmarks`` of the checkout ``script`` (a ``benchmarks/<name>.py``) lives in: the reports' home."""
    return Path(script).resolve().parents[1] / "docs" / "benchmarks"


def cpu_model() -> str:
    """The processor's name as Linux reports it, else what ``platform`` knows (may be empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def installed_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> str:
    """Cores, processor, Python and the versions that set the numbers: torch, Lightning, Horovod."""
    cpu = ", ".join(part for part in (cpu_model(), f"{platform.system()} {platform.machine()}") if part.strip())
    versions = ", ".join(f"{name} {installed_version(dist)}" for name, dist in VERSIONED)
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {versions}"


def command_line(script: str | Path, argv: Sequence[str]) -> str:
    """The command as run from the repository root: ``python benchmarks/<script>.py <argv>``."""
    path = Path(script).resolve()
    return shlex.join(["python", f"{path.parent.name}/{path.name}", *argv])


def header(script: str | Path, argv: Sequence[str], verb: str = "measured", when: datetime.date | None = None) -> str:
    """Two lines: ``<verb>: <date> on <machine>`` and ``command: <command>``."""
    day = (when or datetime.date.today()).isoformat()
    return f"{verb}: {day} on {machine()}\ncommand: {command_line(script, argv)}"


def write_report(
    path: Path, text: str, script: str | Path, argv: Sequence[str], verb: str = "measured", append: bool = False
) -> Path:
    """Write ``text`` under its header to ``path`` (after what is there with ``append``); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = path.read_text().rstrip("\n") + "\n\n" if append and path.exists() else ""
    body = text.rstrip("\n")
    path.write_text(f"{earlier}{header(script, argv, verb)}\n\n{body}\n")
    return path


def publish_report(
    text: str, script: str | Path, argv: Sequence[str], path: Path | None, docs_name: str | None, append: bool = False
) -> Path | None:
    """Print a benchmark's report and write it under its header to ``path``, else to ``docs_name`` beside the
    docs' other reports (``docs_name`` None, as in a smoke run: print only). Returns where it was written."""
    print(text)
    target = path or (docs_dir(script) / docs_name if docs_name else None)
    if target is not None:
        print(f"saved to {write_report(target, text, script, argv, append=append)}")
    return target
