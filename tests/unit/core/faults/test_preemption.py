"""Preemption in the core: Slurm job ids, and the exit status of a preempted run."""

from __future__ import annotations

import signal

from hvd_plugins.core.faults.preemption import TrainingPreempted, slurm_job_id


def test_job_id_names_the_array_task_when_there_is_one() -> None:
    assert slurm_job_id({"SLURM_JOB_ID": "17"}) == "17"
    assert slurm_job_id({"SLURM_JOB_ID": "18", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "3"}) == "12_3"
    assert slurm_job_id({}) is None


def test_a_preempted_run_exits_with_128_plus_the_signal() -> None:
    stop = TrainingPreempted(signal.SIGUSR1, "saved")
    assert isinstance(stop, SystemExit) and stop.code == 128 + signal.SIGUSR1 and str(stop) == "saved"
