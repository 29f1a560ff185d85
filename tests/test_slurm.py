"""Batch jobs on a real one-node Slurm (munge, slurmctld, slurmd started by the test, as root).

Jobs written with ``--ntasks`` and with ``--ntasks-per-node``, launched by ``srun --mpi=pmix`` and
by horovodrun on the allocation's hosts, train. A job caught by its time limit (``--time=2 --signal=USR1@45``)
or by SIGTERM saves a checkpoint, requeues itself, and its next run resumes at that step and ends
with the same weights as a job that was never interrupted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import slurm_jobs

from hvd_plugins.testing.slurm_cluster import OneNodeSlurm

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.slurm",
    "hvd_plugins.core.backend.slurm_hosts",
    "hvd_plugins.core.faults.preemption",
    "hvd_plugins.fabric.strategies.cluster_choice",
    "hvd_plugins.pytorch.preemption",
    "hvd_plugins.pytorch.resume_position",
    "hvd_plugins.testing.slurm_cluster",
)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 48  # slurm_train.py: 256 samples, 2 workers, batch 8, 3 epochs

pytestmark = [pytest.mark.multiprocess, pytest.mark.mpi, pytest.mark.slurm]


@pytest.fixture(scope="module")
def slurm() -> OneNodeSlurm:
    try:
        return slurm_jobs.cluster()
    except RuntimeError as error:
        print(f"skipping the Slurm jobs: {error}")
        pytest.skip(str(error))


def runs(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]


def finish(slurm: OneNodeSlurm, job: int, timeout: float) -> dict[str, str]:
    return slurm.wait_for(job, slurm_jobs.FINAL, timeout)


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
    slurm: OneNodeSlurm,
) -> None:
    """The jobs were submitted when the tests were collected (tests/slurm_jobs.py); here their traces are read."""
    final, folder = slurm_jobs.requeue_jobs()
    assert final["reference"]["JobState"] == "COMPLETED", output(folder / "reference")
    (expected,) = {run["digest"] for run in runs(folder / "reference")}
    for name, signal_name in (("time_limit", "SIGUSR1"), ("sigterm", "SIGTERM")):
        fields = final[name]
        log = output(folder / name)
        assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{name}: {fields}\n{log[-5000:]}"
        first = [run for run in runs(folder / name) if run["restart"] == 0]
        second = [run for run in runs(folder / name) if run["restart"] == 1]
        # Lines of a stopped run are written at its checkpoint, before rank 0 requeues; the other rank may not
        # get to write its own: Slurm ends the job's processes once rank 0 has requeued it.
        assert 1 <= len(first) <= 2 and len(second) == 2, runs(folder / name)
        stopped_at = {run["ended_at_step"] for run in first}
        assert len(stopped_at) == 1 and 0 < min(stopped_at) < STEPS, first  # every rank stopped at the same step
        assert not any(run["finished"] for run in first)
        assert {run["started_at_step"] for run in second} == stopped_at, (first, second)
        assert {run["digest"] for run in second} == {expected}, f"{name} resumed to other weights\n{log[-3000:]}"
        assert f"{signal_name} at epoch" in log and "requeued" in log, log[-3000:]
        assert (folder / name / "hpc_ckpt_1.ckpt").exists()


def test_the_elastic_discovery_script_lists_the_allocations_usable_nodes(slurm: OneNodeSlurm, tmp_path: Path) -> None:
    script = ROOT / "examples" / "elastic" / "discover_hosts_slurm.sh"
    env = {**slurm.env, "SLURM_JOB_NODELIST": slurm.host, "SLURM_NTASKS_PER_NODE": "2(x1)"}
    listed = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and listed.stdout == f"{slurm.host}:2\n", listed
    # a node that Slurm reports down and not responding leaves the job
    down = tmp_path / "sinfo"
    down.write_text("#!/bin/sh\necho 'down*'\n")
    down.chmod(0o755)
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    listed = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and listed.stdout == "", listed
