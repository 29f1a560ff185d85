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
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--strategy", default="instance")
parser.add_argument("--seconds-per-step", type=float, default=0.0, help="in the first run only")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()
RESTART = int(os.environ.get("SLURM_RESTART_COUNT", "0"))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.started_at_step = -1

    def on_train_start(self) -> None:
        self.started_at_step = self.trainer.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:  # tells whoever sends a signal that this rank is training, not still starting up
            (args.out / f"training-restart{RESTART}-rank{self.global_rank}").touch()
        if RESTART == 0 and args.seconds_per_step:
            time.sleep(args.seconds_per_step)
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Every rank saves before rank 0 requeues (which ends the job's processes), so the line of a run
        # that a signal stops is written here, not when the rank exits: rank 0's line is always written.
        record(self, self.trainer, finished=False)


def record(model: Net, trainer: pl.Trainer | None, finished: bool) -> None:
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
model = Net()
trainer = pl.Trainer(
    strategy=HorovodStrategy() if args.strategy == "instance" else args.strategy,
    accelerator="cpu",
    max_epochs=args.epochs,
    default_root_dir=args.out,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))  # a signal's stop exits here
record(model, trainer, finished=True)
