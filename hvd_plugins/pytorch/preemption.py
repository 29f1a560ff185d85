"""Slurm time limits and preemption for HorovodStrategy: save a checkpoint, requeue the job, stop.

What Lightning's SLURMEnvironment does for DDP, made safe for Horovod: Lightning saves inside the
signal handler, where each rank may be in the middle of a different collective. Here the handler
only notes the signal (``core.faults.preemption``), and at the next optimizer step that every rank
agrees on, all ranks save ``hpc_ckpt_<n>.ckpt`` in the Trainer's ``default_root_dir`` (atomically,
through the strategy), rank 0 runs ``scontrol requeue``, and every rank exits with 128 + the signal's
number. The requeued job's ``trainer.fit`` finds that checkpoint itself (Lightning resumes from
``hpc_ckpt_*`` under Slurm when no ``ckpt_path`` is given) and continues at the next batch.
"""

from __future__ import annotations

import logging
import re
import signal
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.faults.preemption import (
    PreemptionNotice,
    TrainingPreempted,
    forget_early_warning_signal,
    requeue_slurm_job,
)
from hvd_plugins.pytorch.utilities.callbacks import StepAwareCallback, replace_callback

log = logging.getLogger(__name__)


def next_hpc_checkpoint(folder: str | Path) -> Path:
    """``hpc_ckpt_<n+1>.ckpt`` after the highest ``n`` in ``folder`` (the name Lightning resumes from)."""
    names = (re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", path.name) for path in Path(folder).glob("hpc_ckpt_*.ckpt"))
    numbers = [int(match.group(1)) for match in names if match]
    return Path(folder) / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt"


class RequeueOnPreemption(StepAwareCallback):
    """Installed by HorovodStrategy while fitting inside a Slurm job (``auto_requeue=True``)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.notice = PreemptionNotice()

    @classmethod
    def install(cls, trainer: Trainer, job_id: str | None) -> None:
        """Add one to ``trainer`` (replacing an earlier fit's); nothing outside a Slurm job."""
        replace_callback(trainer, cls, cls(job_id) if job_id else None)
        if not job_id:
            forget_early_warning_signal()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning's own handlers (registered just before the loop starts), so ours are the ones kept.
        self.notice.install()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.stepped(trainer):
            return  # inside an accumulation: its gradients are not in any checkpoint
        signum = self.notice.agreed_signal(horovod_torch())
        if signum:
            self._save_requeue_and_stop(trainer, signum)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.notice.uninstall(horovod_torch())

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.notice.uninstall()

    def _save_requeue_and_stop(self, trainer: Trainer, signum: int) -> None:
        path = trainer.strategy.broadcast(str(next_hpc_checkpoint(trainer.default_root_dir)))
        trainer.save_checkpoint(path)  # every rank; rank 0 writes, atomically
        outcome = "rank 0 requeues the job"
        if trainer.is_global_zero:
            requeued, outcome = requeue_slurm_job(self.job_id)
            if not requeued:
                log.error("%s; the checkpoint %s stays for a resubmitted job", outcome, path)
        trainer.strategy.barrier("requeued")  # no rank exits (which ends the job) before rank 0 has requeued
        where = f"epoch {trainer.current_epoch}, global step {trainer.global_step}"
        raise TrainingPreempted(
            signum, f"{signal.Signals(signum).name} at {where}: checkpoint saved to {path}; {outcome}; stopping."
        )
