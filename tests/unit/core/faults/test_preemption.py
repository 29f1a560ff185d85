"""Preemption in the core: Slurm job ids, and the exit status of a preempted run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hvd_plugins.core.faults.preemption import TrainingPreempted, requeue_slurm_job, slurm_job_id


def test_job_id_names_the_array_task_when_there_is_one() -> None:
    assert slurm_job_id({"SLURM_JOB_ID": "17"}) == "17"
    assert slurm_job_id({"SLURM_JOB_ID": "18", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "3"}) == "12_3"
    assert slurm_job_id({}) is None


def test_a_preempted_run_exits_with_128_plus_the_signal() -> None:
    stop = TrainingPreempted(signal.SIGUSR1, "saved")
    assert isinstance(stop, SystemExit) and stop.code == 128 + signal.SIGUSR1 and str(stop) == "saved"


@pytest.mark.parametrize(
    ("body", "requeued", "said"),
    [
        ("exit 0", True, "Slurm job 7 requeued"),
        # Slurm ends the job step's processes once it requeues, scontrol among them, sometimes before it exits
        ("kill -TERM $$", True, "requeued (Slurm ended scontrol"),
        ("echo 'Invalid job id specified' >&2; exit 1", False, "failed (exit code 1): Invalid job id specified"),
    ],
)
def test_requeue_reports_what_scontrol_did(
    body: str, requeued: bool, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\n{body}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    worked, message = requeue_slurm_job("7")
    assert worked is requeued and said in message, message
