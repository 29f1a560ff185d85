"""A Trainer fit under an elastic horovodrun (``--host-discovery-script``), with a worker killed or hosts added.

Every worker appends one JSON line per event to ``<out>/events.jsonl``: each trained batch (epoch,
global step, the sample indices), each elastic reset (the step it resumed from), its end (final
weights, world). ``--kill-rank R --kill-step S`` makes the worker of rank R SIGKILL itself at
global step S (once per job), after rewriting the discovery file ``--hosts-file`` without its own
host; ``--grow-step S`` has rank 0 write ``--hosts-after`` there at step S instead, so hosts join.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import psutil
import torch
from _common import listening_addresses
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hvd_plugins.pytorch import HorovodStrategy

SAMPLES, FEATURES = 480, 8


class IndexedData(Dataset):
    """Regression samples that carry their own index, so the test can count who trained what."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.y = self.x @ torch.linspace(-1, 1, FEATURES) + 0.1 * torch.randn(SAMPLES, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Events:
    """One JSON line per event, appended by every worker of the job to one file."""

    def __init__(self, out: Path) -> None:
        self.path = out / "events.jsonl"

    def write(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "time": time.time(), "pid": os.getpid(), **fields}
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")


class Regressor(LightningModule):
    def __init__(self, args: argparse.Namespace, events: Events) -> None:
        super().__init__()
        self.args, self.events = args, events
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self._maybe_leave()
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss, sync_dist=True)
        self.events.write(
            "batch",
            epoch=self.current_epoch,
            step=self.global_step,
            rank=hvd.rank(),
            size=hvd.size(),
            indices=index.tolist(),
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)]

    def on_elastic_reset(self, trainer: Trainer, pl_module: LightningModule, old_size: int, new_size: int) -> None:
        self.events.write("reset", rank=hvd.rank(), old_size=old_size, new_size=new_size)

    def on_train_start(self) -> None:
        self.events.write("train_start", rank=hvd.rank(), size=hvd.size(), step=self.global_step)
        if hvd.rank() == 0 and self.global_step == 0:  # the sockets of the whole job, horovodrun's included
            launcher = next(p for p in psutil.Process().parents() if "horovodrun" in " ".join(p.cmdline()))
            self.events.write("listening", addresses=listening_addresses(launcher.pid))

    def _maybe_leave(self) -> None:
        args = self.args
        marker = args.out / "changed"
        if marker.exists():
            return
        if args.kill_step >= 0 and self.global_step == args.kill_step and hvd.rank() == args.kill_rank:
            marker.write_text("killed")
            host = os.environ["HOROVOD_HOSTNAME"]  # this worker's host leaves the job with it
            others = [line for line in args.hosts_file.read_text().split() if line.split(":")[0] != host]
            args.hosts_file.write_text("\n".join(others) + "\n")
            self.events.write("killed", rank=hvd.rank(), step=self.global_step, host=socket.gethostname())
            os.kill(os.getpid(), signal.SIGKILL)
        if args.grow_step >= 0 and self.global_step == args.grow_step and hvd.rank() == 0:
            marker.write_text("grown")
            args.hosts_file.write_text(args.hosts_after.replace(",", "\n") + "\n")
            self.events.write("grown", rank=hvd.rank(), step=self.global_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hosts-file", type=Path, required=True)
    parser.add_argument("--hosts-after", default="", help="the discovery file's hosts from --grow-step on")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--grow-step", type=int, default=-1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--sync", default="allreduce")
    parser.add_argument("--commit-every", type=int, default=5)
    args = parser.parse_args()
    events = Events(args.out)
    seed_everything(0, verbose=False)
    strategy = HorovodStrategy(sync=args.sync, commit_every_n_steps=args.commit_every, scale_lr=True)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=args.max_steps,
        logger=CSVLogger(args.out / "logs", name="elastic"),
        callbacks=[ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=10, save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
        sync_batchnorm=True,
    )
    data = DataLoader(IndexedData(), batch_size=8, shuffle=True)
    validation = DataLoader(IndexedData(), batch_size=32)
    module = Regressor(args, events)
    trainer.fit(module, data, validation)
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
    events.write(
        "end",
        rank=hvd.rank(),
        size=hvd.size(),
        step=trainer.global_step,
        weights=weights.tolist(),
        lr=lrs,
        resets=strategy.elastic.resets if strategy.elastic else 0,
        log_dir=trainer.log_dir,
    )


if __name__ == "__main__":
    main()
