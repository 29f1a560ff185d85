"""Slurm helpers that need no cluster: the allocation's host list, job ids, checkpoint names, early signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_plugins.core.backend.slurm_hosts import horovodrun_hosts, tasks_per_node
from hvd_plugins.core.faults.preemption import TrainingPreempted, slurm_job_id
from hvd_plugins.pytorch.preemption import next_hpc_checkpoint


def test_tasks_per_node_expands_slurms_repeat_counts() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="2x3"):
        tasks_per_node("2x3")


def test_horovodrun_hosts_outside_an_allocation_says_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="SLURM_TASKS_PER_NODE"):
        horovodrun_hosts({})


def test_job_id_names_the_array_task_when_there_is_one() -> None:
    assert slurm_job_id({"SLURM_JOB_ID": "17"}) == "17"
    assert slurm_job_id({"SLURM_JOB_ID": "18", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "3"}) == "12_3"
    assert slurm_job_id({}) is None


def test_hpc_checkpoints_are_numbered_after_the_highest(tmp_path: Path) -> None:
    assert next_hpc_checkpoint(tmp_path).name == "hpc_ckpt_1.ckpt"
    for name in ("hpc_ckpt_1.ckpt", "hpc_ckpt_7.ckpt", "hpc_ckpt_x.ckpt", "last.ckpt"):
        (tmp_path / name).touch()
    assert next_hpc_checkpoint(tmp_path).name == "hpc_ckpt_8.ckpt"


def test_a_preempted_run_exits_with_128_plus_the_signal() -> None:
    stop = TrainingPreempted(signal.SIGUSR1, "saved")
    assert isinstance(stop, SystemExit) and stop.code == 128 + signal.SIGUSR1 and str(stop) == "saved"


@pytest.mark.parametrize(
    ("variables", "survives"),
    [
        ({"SLURM_JOB_ID": "5", "PMIX_RANK": "0"}, True),  # a worker srun --mpi=pmix started
        ({"SLURM_JOB_ID": "5"}, False),  # a Slurm job that is no Horovod worker (DDP): Lightning's handling
        ({"PMIX_RANK": "0"}, False),  # MPI outside Slurm: no time-limit warning to expect
    ],
    ids=["horovod-worker-in-slurm", "slurm-without-launcher", "mpi-without-slurm"],
)
def test_importing_the_package_in_a_slurm_worker_survives_an_early_time_limit_warning(
    variables: dict[str, str], survives: bool
) -> None:
    """Slurm may send --signal=USR1@T during start-up: a Horovod worker's import notes it instead of dying."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMIX_", "PMI_", "OMPI_", "HOROVOD_"))}
    env.update(variables)
    # only the signal part of the import: a PMIX_RANK makes importing Horovod try to start MPI
    code = (
        "import os, signal\n"
        "from hvd_plugins.core.faults.preemption import note_early_warning_signal\n"
        "note_early_warning_signal(); os.kill(os.getpid(), signal.SIGUSR1); print('alive')"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if survives:
        assert done.returncode == 0 and "alive" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode == -signal.SIGUSR1
