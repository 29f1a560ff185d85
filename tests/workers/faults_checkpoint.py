"""Checkpoints survive a job killed while writing one, and resuming continues the same run.

``--phase reference``: 4 epochs, uninterrupted. ``--phase crash``: checkpoints every epoch; rank 0
is SIGKILLed while pickling the epoch-2 checkpoint (after the temporary file was opened).
``--phase resume``: continues from ``--resume-from`` to 4 epochs. ``--phase reference,crash`` runs
both, in that order, in one job. Each rank writes, per phase that finished, its per-epoch mean loss
(averaged over all ranks) and a digest of its final weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import horovod.torch as hvd
from _common import parse_out, write_result
from faults_common import digest, record_pid, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from models import CrashWhileSaving, FaultNet, fault_loader

from hvd_plugins.pytorch import HorovodStrategy

OUT, _ = parse_out()
parser = argparse.ArgumentParser()
parser.add_argument("--phase", required=True, help="reference, crash or resume, or several separated by commas")
parser.add_argument("--ckpt-dir", type=Path, required=True)
parser.add_argument("--resume-from", type=Path, default=None)
ARGS, _ = parser.parse_known_args()
EPOCHS, KILL_WHILE_SAVING_EPOCH = 4, 2
PHASES = ("reference", "crash", "resume")


def run_phase(phase: str) -> dict[str, Any]:
    callbacks = []
    if phase == "crash":
        callbacks.append(ModelCheckpoint(dirpath=ARGS.ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    fit = trainer(HorovodStrategy(), epochs=EPOCHS, callbacks=callbacks, enable_checkpointing=phase == "crash")
    record_pid(OUT, hvd.rank())  # Horovod runs once the Trainer exists
    module = CrashWhileSaving(KILL_WHILE_SAVING_EPOCH) if phase == "crash" else FaultNet()
    resume_from = ARGS.resume_from if phase == "resume" else None
    fit.fit(module, fault_loader(), ckpt_path=str(resume_from) if resume_from else None)
    weights = module.first.weight.flatten().tolist()
    return {"epoch_losses": module.epoch_losses, "digest": digest(module), "weights": weights}


phases = ARGS.phase.split(",")
if not set(phases) <= set(PHASES):
    raise ValueError(f"--phase {ARGS.phase!r}: each phase must be one of {PHASES}")
report: dict[str, Any] = {}
for phase in phases:
    report[phase] = run_phase(phase)
    write_result(OUT, hvd.rank(), report)  # before the next phase, which may be killed
