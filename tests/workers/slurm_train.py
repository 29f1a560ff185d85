"""A training job for Slurm batch scripts: slow in its first run (so a time limit or signal catches it), fast after.

Every rank of every run appends one JSON line to ``<out>/runs.jsonl``: the Slurm restart count, the
global step the run started from, where it ended, and a digest of the final weights when it finished.
A run that a signal stops writes its line when it saves its checkpoint, before rank 0 requeues.
The strategy comes from ``--strategy`` ("instance" or a registered name such as "horovod").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from models import TanhClassifier
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--strategy", default="instance")
parser.add_argument("--seconds-per-step", type=float, default=0.0, help="in the first run only")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()
RESTART = int(os.environ.get("SLURM_RESTART_COUNT", "0"))


class FirstRunIsSlow(Callback):
    """In the first run, each step sleeps ``--seconds-per-step`` (so a time limit or signal catches it), and each
    rank marks when it began training; every save records the run (``record``)."""

    @staticmethod
    def on_step(module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:  # tells whoever sends a signal that this rank is training, not still starting up
            (args.out / f"training-restart{RESTART}-rank{module.global_rank}").touch()
        if RESTART == 0 and args.seconds_per_step:
            time.sleep(args.seconds_per_step)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every rank saves before rank 0 requeues (which ends the job's processes), so the line of a run
        # that a signal stops is written here, not when the rank exits: rank 0's line is always written.
        record(pl_module, trainer, finished=False)


def record(model: TanhClassifier, trainer: pl.Trainer | None, finished: bool) -> None:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    line = {
        "rank": int(os.environ.get("SLURM_PROCID", os.environ.get("HOROVOD_RANK", "0"))),
        "restart": RESTART,
        "started_at_step": model.started_at_step,
        "ended_at_step": trainer.global_step if trainer else -1,
        "finished": finished,
        "digest": digest if finished else None,
    }
    with open(args.out / "runs.jsonl", "a") as log:
        log.write(json.dumps(line) + "\n")


generator = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=generator)
y = (x[:, 0] > 0).long()
model = TanhClassifier(on_step=FirstRunIsSlow.on_step)
trainer = pl.Trainer(
    strategy=HorovodStrategy() if args.strategy == "instance" else args.strategy,
    accelerator="cpu",
    max_epochs=args.epochs,
    default_root_dir=args.out,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[FirstRunIsSlow()],
)
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))  # a signal's stop exits here
record(model, trainer, finished=True)
