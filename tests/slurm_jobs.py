"""The one-node Slurm of the test session, and the requeue jobs it starts as soon as the tests are collected.

A job that waits for its time limit spends a minute or two asleep, so the time-limit and SIGTERM
jobs are submitted when collection ends (only if their test was collected) and run beside the rest
of the suite; ``tests/test_slurm.py`` then reads what they left. A background thread starts a
requeued run 15 s after the requeue (Slurm would hold it back for about two minutes) and sends the SIGTERM a few
steps after both ranks began training (a loaded machine may take long to start them; a process
killed before it imported anything has nothing to save).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hvd_plugins.testing.launch import mpi_launch_problem
from hvd_plugins.testing.slurm_cluster import OneNodeSlurm, slurm_problem

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "slurm_train.py"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
SECONDS_PER_STEP = "2.0"  # first runs train 48 steps for 96 s, longer than any moment the signal may come
SIGTERM_AFTER_TRAINING_SECONDS = 8.0  # a few steps after both ranks of the first run began training
REQUEUED_START_AFTER_SECONDS = 15.0
"""How long a requeued job waits at least before it is started at once (Slurm would hold it about two minutes):
the old run's step may still be ending (srun waits up to 12 s for it)."""
REQUEUED_START_BY_SECONDS = 90.0
"""When a requeued job is started even though a step daemon of its old run is still alive."""


@dataclass
class Session:
    cluster: OneNodeSlurm | None = None
    problem: str | None = None
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hvd_slurm_jobs_")))
    jobs: dict[str, int] = field(default_factory=dict)
    final: dict[str, dict[str, str]] = field(default_factory=dict)  # each job's fields once it ended
    ready: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)


_session = Session()
_starting = threading.Lock()


def batch_script(folder: Path, name: str, directives: list[str], body: str) -> Path:
    script = folder / name
    path_line = f'export PATH="{Path(sys.executable).parent}:$PATH"'
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -eu", path_line, body]
    script.write_text("\n".join(lines) + "\n")
    return script


def worker_job(folder: Path, name: str, extra_directives: list[str], worker_args: str) -> Path:
    out = folder / name
    out.mkdir(parents=True, exist_ok=True)
    return batch_script(
        folder,
        f"{name}.sbatch",
        ["--ntasks=2", f"--output={out}/slurm.out", "--open-mode=append", *extra_directives],
        f"srun --mpi=pmix python {WORKER} --out {out} {worker_args}",
    )


def cluster() -> OneNodeSlurm:
    """The session's one-node Slurm, started on first use; raises RuntimeError with the reason it cannot run."""
    with _starting:
        return _started_cluster()


def _started_cluster() -> OneNodeSlurm:
    if _session.cluster is None and _session.problem is None:
        _session.problem = slurm_problem() or mpi_launch_problem()
        if _session.problem is None:
            try:
                _session.cluster = OneNodeSlurm(cpus=6, folder=_session.folder / "cluster")
                _session.cluster.start()
            except RuntimeError as error:
                _session.problem, _session.cluster = str(error), None
    if _session.cluster is None:
        raise RuntimeError(_session.problem)
    return _session.cluster


def start_requeue_jobs() -> None:
    """Submit the reference, time-limit and SIGTERM jobs, and tend them in the background."""
    threading.Thread(target=_submit_and_tend, name="slurm-requeue-jobs", daemon=True).start()


def requeue_jobs(timeout: float = 600) -> tuple[dict[str, dict[str, str]], Path]:
    """Wait until every requeue job has ended; returns each job's last fields by name, and their folder.

    The fields are kept when a job ends: Slurm forgets finished jobs after a while (MinJobAge).
    """
    if not _session.ready.is_set() and not _session.jobs:
        start_requeue_jobs()  # the test was run without the collection hook (e.g. by node id)
    if not _session.ready.wait(timeout):
        raise TimeoutError(f"the Slurm requeue jobs did not end in {timeout:.0f} s: {_session.jobs}")
    return dict(_session.final), _session.folder


def stop() -> None:
    _session.stop.set()
    if _session.cluster is not None:
        subprocess.run(["scancel", "--user=root"], env=_session.cluster.env, capture_output=True, check=False)
        _session.cluster.stop()
        _session.cluster = None


def step_daemons_alive(job: int) -> bool:
    """Whether a ``slurmstepd`` of ``job`` still runs on this machine (the one node): a step of a requeued run
    started while its old run's daemon of the same step id ends fails to launch, and its own daemon hangs."""
    marker = f"slurmstepd: [{job}."
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(part.startswith(marker) for part in process.info["cmdline"] or []):
                return True
    return False


def _submit_and_tend() -> None:
    try:
        slurm = cluster()
    except RuntimeError:
        _session.ready.set()
        return
    folder = _session.folder
    _session.jobs = {
        "reference": slurm.sbatch(worker_job(folder, "reference", [], "--strategy instance")),
        "time_limit": slurm.sbatch(
            worker_job(
                folder,
                "time_limit",
                ["--time=2", "--signal=USR1@45", "--requeue"],
                f"--strategy horovod --seconds-per-step {SECONDS_PER_STEP}",
            )
        ),
        "sigterm": slurm.sbatch(worker_job(folder, "sigterm", ["--requeue"], f"--seconds-per-step {SECONDS_PER_STEP}")),
    }
    training_since: float | None = None
    signalled = False
    requeued_at: dict[str, float] = {}
    final_seen: dict[str, tuple[str | None, str | None]] = {}
    while not _session.stop.is_set():
        states = {name: slurm.job_fields(job) for name, job in _session.jobs.items()}
        for name, fields in states.items():
            if fields.get("JobState") == "PENDING" and fields.get("Restarts", "0") != "0":
                waited = time.monotonic() - requeued_at.setdefault(name, time.monotonic())
                old_run_ended = not step_daemons_alive(_session.jobs[name])
                if waited >= REQUEUED_START_BY_SECONDS or (waited >= REQUEUED_START_AFTER_SECONDS and old_run_ended):
                    slurm.scontrol("update", f"JobId={_session.jobs[name]}", "StartTime=now", check=False)
        sigterm = states["sigterm"]
        if not signalled and sigterm.get("JobState") == "RUNNING" and sigterm.get("Restarts") == "0":
            if len(list((folder / "sigterm").glob("training-restart0-rank*"))) == 2:
                training_since = training_since or time.monotonic()
            if training_since is not None and time.monotonic() - training_since > SIGTERM_AFTER_TRAINING_SECONDS:
                subprocess.run(["scancel", "--signal=TERM", str(_session.jobs["sigterm"])], env=slurm.env, check=False)
                signalled = True
        for name, fields in states.items():
            # a requeue can show the ended run's state for a moment before the job is pending again: a state
            # counts as final once two polls in a row see it, with the same restart count
            seen = (fields.get("JobState"), fields.get("Restarts"))
            if seen[0] in FINAL and final_seen.get(name) == seen:
                _session.final.setdefault(name, fields)
            final_seen[name] = seen
        if len(_session.final) == len(_session.jobs):
            break
        time.sleep(2)
    _session.ready.set()
