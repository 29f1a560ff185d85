"""A Trainer fit under an elastic horovodrun (``--host-discovery-script``), with a worker killed or hosts added.

Every worker appends one JSON line per event to ``<out>/events.jsonl``: each trained batch (epoch,
global step, the sample indices), each elastic reset (the step it resumed from), its end (final
weights, world). ``--kill-rank``/``--kill-step`` and ``--grow-step`` make a worker
leave or hosts join (``elastic_common.leave_or_grow``).
"""

from __future__ import annotations

import argparse
from typing import Any

import horovod.torch as hvd
import psutil
import torch
from _common import listening_addresses
from elastic_common import Events, leave_or_grow, parser
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from models import ElasticRegressor, IndexedData
from torch.utils.data import DataLoader

from hvd_plugins.pytorch import HorovodStrategy


class EventLog(Callback):
    """The worker's events (tests/test_elastic.py reads them); ``on_step`` also leaves or grows the job on cue."""

    def __init__(self, args: argparse.Namespace, events: Events) -> None:
        self.args, self.events = args, events

    def on_step(self, module: LightningModule, batch: Any, batch_idx: int) -> None:
        """First in every training step (the model's ``on_step``)."""
        leave_or_grow(self.args, self.events, module.global_step)
        self.events.write(
            "batch",
            epoch=module.current_epoch,
            step=module.global_step,
            rank=hvd.rank(),
            size=hvd.size(),
            indices=batch[2].tolist(),
        )

    def on_elastic_reset(self, trainer: Trainer, pl_module: LightningModule, old_size: int, new_size: int) -> None:
        self.events.write("reset", rank=hvd.rank(), old_size=old_size, new_size=new_size)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        daso = trainer.strategy.daso_sync  # DASO's schedule as restored from the commit
        self.events.write(
            "train_start", rank=hvd.rank(), size=hvd.size(), step=trainer.global_step,
            daso_epoch=daso.schedule.epoch if daso is not None else None,
        )  # fmt: skip
        if hvd.rank() == 0 and trainer.global_step == 0:  # the sockets of the whole job, horovodrun's included
            launcher = next(p for p in psutil.Process().parents() if "horovodrun" in " ".join(p.cmdline()))
            self.events.write("listening", addresses=listening_addresses(launcher.pid))


def committed_part_bytes(strategy: HorovodStrategy) -> int:
    """Bytes of sharded optimizer parts this worker keeps of the last commit (0 unsharded)."""
    held = strategy.elastic.held if strategy.elastic is not None else None
    return sum(t.numel() for parts in (held[1] if held else []) if parts for t in parts.values())


def main() -> None:
    arguments = parser()
    arguments.add_argument("--sync", default="allreduce")
    arguments.add_argument("--shard", default="none")
    arguments.add_argument("--freeze-first", action="store_true", help="train with the first layer frozen")
    args = arguments.parse_args()
    events = Events(args.out)
    seed_everything(0, verbose=False)
    units = {"auto_wrap_policy": {torch.nn.Linear}} if args.shard == "parameters" else {}  # BatchNorm's stay whole
    strategy = HorovodStrategy(
        sync=args.sync, shard=args.shard, commit_every_n_steps=args.commit_every, scale_lr=True, **units
    )
    log = EventLog(args, events)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=args.max_steps,
        logger=CSVLogger(args.out / "logs", name="elastic"),
        callbacks=[ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=10, save_top_k=-1), log],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
        sync_batchnorm=args.sync != "daso",  # HorovodStrategy refuses DASO with synchronized BatchNorm
    )
    data = DataLoader(IndexedData(), batch_size=8, shuffle=True)
    validation = DataLoader(IndexedData(), batch_size=32)
    module = ElasticRegressor(on_step=log.on_step)
    if args.freeze_first:
        module.net[0].requires_grad_(False)
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
        commit_held_bytes=committed_part_bytes(strategy),
        log_dir=trainer.log_dir,
    )


if __name__ == "__main__":
    main()
