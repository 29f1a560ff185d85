"""Launch real Horovod jobs from pytest and collect what each rank reported.

Thin test-side names over ``hvd_plugins.testing.launch``: worker scripts are looked up in
``tests/workers`` and a job that outlives its timeout fails the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hvd_plugins.testing.launch import JobResult, horovodrun, horovodrun_path, run_bounded

__all__ = ["REPO", "TWO_NODES", "WORKERS", "JobResult", "horovodrun_path", "run_job", "run_single"]

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
TWO_NODES = "localhost:2,127.0.0.1:2"  # one machine, two emulated nodes of two workers


def _worker_path(script: str | Path) -> Path:
    script = Path(script)
    return script if script.is_absolute() else WORKERS / script


def _fail_on_timeout(job: JobResult, what: str, timeout: float) -> JobResult:
    if job.timed_out:
        raise AssertionError(f"{what} did not finish within {timeout}s:\n{job.output[-6000:]}")
    return job


def run_job(
    script: str | Path,
    *args: str,
    np: int = 2,
    hosts: str | None = None,
    out_dir: Path | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    python: bool = True,
    console_script: bool = False,
) -> JobResult:
    """Run ``horovodrun -np N -H hosts --gloo python script args`` and gather ``rank*.json``.

    The job runs in its own process group and is killed as a whole when it outlives
    ``timeout``, so a hang fails the test instead of blocking the suite. horovodrun's build
    probe, which costs seconds per launch, is skipped unless ``console_script`` asks for the
    ``horovodrun`` command itself.
    """
    script = _worker_path(script)
    worker = ([sys.executable, str(script)] if python else [str(script)]) + list(args)
    job = horovodrun(
        worker, np=np, hosts=hosts, out_dir=out_dir, timeout=timeout, env=env, cwd=REPO, probe_build=console_script
    )
    return _fail_on_timeout(job, "horovodrun", timeout)


def run_single(script: str | Path, *args: str, out_dir: Path | None = None, timeout: float = 300) -> JobResult:
    """Run a worker script as one plain python process (no launcher, no Horovod variables)."""
    command = [sys.executable, str(_worker_path(script)), *args]
    command += ["--out", str(out_dir)] if out_dir is not None else []
    job = run_bounded(command, timeout, cwd=REPO, out_dir=out_dir, drop_launcher_env=True)
    return _fail_on_timeout(job, "the single process", timeout)
