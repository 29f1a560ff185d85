"""Time limits and preemption in batch jobs: note the signal, agree on it, save, requeue, stop.

Slurm warns a job before its time limit (``#SBATCH --signal=USR1@120``) and sends SIGTERM before it
kills a job (time limit, preemption, ``scancel``). Each rank receives its signal at a different moment,
inside a different step, so the handler only notes it. At every optimizer-step boundary the ranks
combine what they noted in a one-integer allreduce, posted at one boundary and read at the next (so
it overlaps a whole step and never waits on the network), and all of them act on the same step.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from types import FrameType, ModuleType
from typing import Any

import torch

from hvd_plugins.core.backend.launch_env import launched_by_launcher

log = logging.getLogger(__name__)

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
"""Slurm's usual warning signal (``--signal=USR1@T``) and the signal that precedes every kill."""
AGREEMENT_NAME = "hvd_plugins.preemption"
_early: dict[str, int] = {"received": 0}


def note_early_warning_signal(environ: Mapping[str, str] = os.environ) -> None:
    """In a Horovod worker of a Slurm job, note a SIGUSR1 that comes before training starts instead of dying.

    Slurm may send ``--signal=USR1@T`` up to a minute early, even while the script is still importing;
    the noted signal is acted on at the first optimizer step. Only in workers a launcher started for
    Horovod (srun --mpi, mpirun, horovodrun), so a DDP job keeps Lightning's own handling; left alone
    when a handler is already set.
    """
    if slurm_job_id(environ) and launched_by_launcher(environ) and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        signal.signal(signal.SIGUSR1, _note_early)


def forget_early_warning_signal() -> None:
    """Give SIGUSR1 back its default (a fit without ``auto_requeue``); a signal noted so far is dropped."""
    if signal.getsignal(signal.SIGUSR1) is _note_early:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    _early["received"] = 0


def _note_early(signum: int, _frame: FrameType | None) -> None:
    _early["received"] = _early["received"] or signum


def slurm_job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The id ``scontrol requeue`` takes for this job (``<array job>_<task>`` in job arrays); None outside Slurm."""
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return environ.get("SLURM_JOB_ID") or None


def requeue_slurm_job(job_id: str) -> tuple[bool, str]:
    """Run ``scontrol requeue``; returns whether it worked and what to tell the user."""
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        return False, f"scontrol requeue {job_id} could not run ({error})"
    if done.returncode in (-signal.SIGTERM, -signal.SIGKILL) and not (done.stderr or done.stdout).strip():
        # The requeue ends every process of the job's step, scontrol itself among them, sometimes before it exits.
        return True, f"Slurm job {job_id} requeued (Slurm ended scontrol with the job's other processes)"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        return False, f"scontrol requeue {job_id} failed (exit code {done.returncode}): {said}"
    return True, f"Slurm job {job_id} requeued"


class TrainingPreempted(SystemExit):
    """Raised on every rank after the checkpoint is saved; the process exits with 128 + the signal's number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptionNotice:
    """Signal handlers that only note the signal, and the lagged all-rank agreement on it."""

    def __init__(self, signals: tuple[signal.Signals, ...] = REQUEUE_SIGNALS) -> None:
        self.signals = signals
        self.received = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._pending: Any = None  # the handle of the agreement posted at the last boundary

    def install(self) -> None:
        """Replace the handlers of ``signals`` (SIGTERM's included: a save must come before the exit).

        A warning that came before (while importing, restoring, sanity checking) is taken over.
        """
        self.received = self.received or _early["received"]
        _early["received"] = 0
        for signum in self.signals:
            self._previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self._note)

    def uninstall(self, hvd: ModuleType | None = None) -> None:
        """Give the signals back; settle an agreement still in flight (every rank calls this at the same point)."""
        if self._pending is not None and hvd is not None:
            hvd.synchronize(self._pending)
        self._pending = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if not self.received:
            self.received = signum
            log.warning("received %s; the checkpoint is saved at the next optimizer step", signal.Signals(signum).name)

    def agreed_signal(self, hvd: ModuleType) -> int:
        """At a step boundary, on every rank: the signal some rank had noted one boundary earlier (0: none).

        Every rank posts its note at each boundary and reads the previous boundary's result, so all ranks
        see the same answer at the same step.
        """
        result = 0
        if self._pending is not None:
            result = int(hvd.synchronize(self._pending).item())
        note = torch.tensor([self.received], dtype=torch.int32)
        self._pending = hvd.allreduce_async(note, name=AGREEMENT_NAME, op=hvd.Max)
        return result
