"""Batch jobs on a real one-node Slurm (munge, slurmctld, slurmd started by the test, as root).

Jobs written with ``--ntasks`` and with ``--ntasks-per-node``, launched by ``srun --mpi=pmix`` and
by horovodrun on the allocation's hosts, train. A job caught by its time limit (``--signal=USR1@50``)
or by SIGTERM saves a checkpoint, requeues itself, and its next run resumes at that step and ends
with the same weights as a job that was never interrupted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hvd_plugins.testing.launch import mpi_launch_problem
from hvd_plugins.testing.slurm_cluster import OneNodeSlurm, slurm_problem

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "slurm_train.py"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STEPS = 48  # slurm_train.py: 256 samples, 2 workers, batch 8, 3 epochs

pytestmark = [pytest.mark.multiprocess, pytest.mark.mpi, pytest.mark.slurm]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    problem = slurm_problem() or mpi_launch_problem()
    if problem:
        print(f"skipping the Slurm jobs: {problem}")
        pytest.skip(problem)
    with OneNodeSlurm(cpus=6, folder=tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def batch_script(folder: Path, name: str, directives: list[str], body: str) -> Path:
    script = folder / name
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "set -eu",
        f'export PATH="{Path(sys.executable).parent}:$PATH"',
        body,
    ]
    script.write_text("\n".join(lines) + "\n")
    return script


def worker_job(folder: Path, name: str, extra_directives: list[str], worker_args: str) -> Path:
    out = folder / name
    out.mkdir()
    return batch_script(
        folder,
        f"{name}.sbatch",
        ["--ntasks=2", f"--output={out}/slurm.out", "--open-mode=append", *extra_directives],
        f"srun --mpi=pmix python {WORKER} --out {out} {worker_args}",
    )


def runs(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]


def finish(slurm: OneNodeSlurm, job: int, timeout: float) -> dict[str, str]:
    """Wait for ``job`` to end; a requeued run is started at once instead of after Slurm's requeue delay."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = slurm.job_fields(job)
        if fields.get("JobState") in FINAL:
            return fields
        if fields.get("JobState") == "PENDING" and fields.get("Restarts", "0") != "0":
            slurm.scontrol("update", f"JobId={job}", "StartTime=now", check=False)
        time.sleep(2)
    raise TimeoutError(f"job {job} did not end in {timeout:.0f} s: {slurm.job_fields(job)}\n{slurm.logs()}")


def output(folder: Path) -> str:
    return (folder / "slurm.out").read_text(errors="replace") if (folder / "slurm.out").exists() else ""


def test_example_batch_scripts_train_with_ntasks_and_with_horovodrun_on_the_allocation(
    slurm: OneNodeSlurm, tmp_path: Path
) -> None:
    jobs = {}
    for script in ("train_mpi.sbatch", "train_gloo.sbatch"):
        out = tmp_path / script
        jobs[script] = (
            slurm.sbatch(
                ROOT / "examples" / "slurm" / script,
                f"--output={out}.log",
                f"--export=ALL,EPOCHS=3,OUT_DIR={out},PATH={Path(sys.executable).parent}:{os.environ['PATH']}",
                cwd=ROOT,
            ),
            out,
        )
    for script, (job, out) in jobs.items():
        fields = finish(slurm, job, timeout=240)
        log = Path(f"{out}.log").read_text(errors="replace")
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{script}: {fields}\n{log[-4000:]}"
        accuracy = float(log.split("validation accuracy:")[-1].split()[0])
        assert accuracy > 0.8, log[-2000:]
        assert (out / "logs" / "metrics.csv").exists()


def test_time_limit_and_sigterm_checkpoint_requeue_and_resume_to_the_uninterrupted_weights(
    slurm: OneNodeSlurm, tmp_path: Path
) -> None:
    reference = slurm.sbatch(worker_job(tmp_path, "reference", [], "--strategy instance"))
    # Slow first runs (1.5 s a step: 72 s of training) so the signal always lands inside training.
    time_limit = slurm.sbatch(
        worker_job(
            tmp_path,
            "time_limit",
            ["--time=1", "--signal=USR1@50", "--requeue"],
            "--strategy horovod --seconds-per-step 1.5",
        )
    )
    sigterm = slurm.sbatch(worker_job(tmp_path, "sigterm", ["--requeue"], "--seconds-per-step 1.5"))
    deadline = time.monotonic() + 120
    while slurm.job_fields(sigterm).get("JobState") != "RUNNING" and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(20)  # well into training
    subprocess.run(["scancel", "--signal=TERM", str(sigterm)], env=slurm.env, check=True)

    assert finish(slurm, reference, timeout=180)["JobState"] == "COMPLETED", output(tmp_path / "reference")
    (expected,) = {run["digest"] for run in runs(tmp_path / "reference")}
    for name, job, signal_name in (("time_limit", time_limit, "SIGUSR1"), ("sigterm", sigterm, "SIGTERM")):
        fields = finish(slurm, job, timeout=300)
        folder = tmp_path / name
        log = output(folder)
        assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{name}: {fields}\n{log[-5000:]}"
        first = [run for run in runs(folder) if run["restart"] == 0]
        second = [run for run in runs(folder) if run["restart"] == 1]
        assert len(first) == 2 and len(second) == 2, runs(folder)
        stopped_at = {run["ended_at_step"] for run in first}
        assert len(stopped_at) == 1 and 0 < min(stopped_at) < STEPS, first  # every rank stopped at the same step
        assert not any(run["finished"] for run in first)
        assert {run["started_at_step"] for run in second} == stopped_at, (first, second)
        assert {run["digest"] for run in second} == {expected}, f"{name} resumed to other weights\n{log[-3000:]}"
        assert f"{signal_name} at epoch" in log and "requeued" in log, log[-3000:]
        assert (folder / "hpc_ckpt_1.ckpt").exists()
