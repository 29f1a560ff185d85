"""Launch real Horovod jobs from pytest and collect what each rank reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
TWO_NODES = "localhost:2,127.0.0.1:2"  # one machine, two emulated nodes of two workers


@dataclass
class JobResult:
    returncode: int
    output: str
    seconds: float
    results: dict[int, dict]

    def check(self) -> JobResult:
        """Raise with the job's output when it failed."""
        if self.returncode != 0:
            raise AssertionError(f"horovodrun exited with {self.returncode}:\n{self.output[-6000:]}")
        return self


def horovodrun_path() -> str:
    candidate = Path(sys.executable).with_name("horovodrun")
    return str(candidate) if candidate.exists() else "horovodrun"


def run_job(
    script: str | Path,
    *args: str,
    np: int = 2,
    hosts: str | None = None,
    out_dir: Path | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    python: bool = True,
) -> JobResult:
    """Run ``horovodrun -np N -H hosts --gloo python script args`` and gather ``rank*.json``.

    The job runs in its own process group and is killed as a whole when it outlives
    ``timeout``, so a hang fails the test instead of blocking the suite.
    """
    script = Path(script)
    if not script.is_absolute():
        script = WORKERS / script
    command = [horovodrun_path(), "-np", str(np), "-H", hosts or f"localhost:{np}", "--gloo"]
    command += ([sys.executable, str(script)] if python else [str(script)]) + list(args)
    if out_dir is not None:
        command += ["--out", str(out_dir)]
    # A loaded machine can take longer than Horovod's default 30 s to start all workers.
    full_env = {
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "180",
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
    }
    full_env.update(env or {})
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"horovodrun did not finish within {timeout}s:\n{output[-6000:]}") from None
    seconds = time.monotonic() - start
    results = {}
    if out_dir is not None:
        for path in sorted(out_dir.glob("rank*.json")):
            results[int(path.stem[4:])] = json.loads(path.read_text())
    return JobResult(process.returncode, output, seconds, results)


def run_single(script: str | Path, *args: str, out_dir: Path | None = None, timeout: float = 300) -> JobResult:
    """Run a worker script as one plain python process (no launcher)."""
    script = Path(script)
    if not script.is_absolute():
        script = WORKERS / script
    command = [sys.executable, str(script), *args] + (["--out", str(out_dir)] if out_dir is not None else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    for name in list(env):
        if name.startswith(("HOROVOD_", "OMPI_", "PMI_")):
            del env[name]
    start = time.monotonic()
    completed = subprocess.run(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    results = {}
    if out_dir is not None:
        for path in sorted(out_dir.glob("rank*.json")):
            results[int(path.stem[4:])] = json.loads(path.read_text())
    return JobResult(completed.returncode, completed.stdout, time.monotonic() - start, results)
