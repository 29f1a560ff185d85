"""Train a tiny model with every monitoring callback and report what they measured, per rank.

Flags: --compression, --sync, --accumulate; the timeline goes to ``<out>/timeline_rank<R>.json``
so the test can tell which ranks wrote one.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_out, write_result
from models import TinyRegression

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.pytorch import HorovodStrategy
from hvd_plugins.pytorch.callbacks import CommunicationMonitor, HorovodTimeline, PeakMemoryMonitor

EPOCHS = 2
SAMPLES = 64
BATCH = 8


class StepsPerEpoch(Callback):
    """Optimizer steps this worker took in each epoch: the test's yardstick for the byte counts."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self._start = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = trainer.global_step

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.steps.append(trainer.global_step - self._start)


def main() -> None:
    out, _ = parse_out()
    parser = argparse.ArgumentParser()
    parser.add_argument("--compression", default="none")
    parser.add_argument("--sync", default="allreduce")
    parser.add_argument("--accumulate", type=int, default=1)
    args, _ = parser.parse_known_args()

    seed_everything(0)
    # Built before the Trainer: it must set HOROVOD_TIMELINE before the strategy starts Horovod.
    rank_hint = int(os.environ.get("HOROVOD_RANK", "0"))  # hvd.init() has not run yet
    timeline = HorovodTimeline(out / f"timeline_rank{rank_hint}.json", start_step=1, stop_step=3)
    memory, comm, steps = PeakMemoryMonitor(), CommunicationMonitor(), StepsPerEpoch()
    # The model is tiny, so the two-level path is forced (flat_below_mb=0): the test checks its legs.
    two_level_even_when_tiny = {"flat_below_mb": 0.0} if args.sync == "hierarchical" else {}
    trainer = Trainer(
        strategy=HorovodStrategy(compression=args.compression, sync=args.sync, **two_level_even_when_tiny),
        accelerator="cpu",
        max_epochs=EPOCHS,
        accumulate_grad_batches=args.accumulate,
        logger=CSVLogger(out, name="", version="logs"),
        callbacks=[memory, comm, timeline, steps],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    data = TensorDataset(torch.randn(SAMPLES, 8), torch.randn(SAMPLES, 4))
    model = TinyRegression(features=8, outputs=4, lr=0.01)
    trainer.fit(model, DataLoader(data, batch_size=BATCH))
    hvd = horovod_torch()

    write_result(
        out,
        hvd.rank(),
        {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "cross_size": hvd.cross_size(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "parameter_tensors": len(list(model.parameters())),
            "steps_per_epoch": steps.steps,
            "comm": [{"epoch": t.epoch, "per_worker": t.per_worker} for t in comm.history],
            "memory": [{"stage": s.stage, "per_worker": s.per_worker} for s in memory.history],
            "timeline_path": str(timeline.path),
            "timeline_recording_after_fit": timeline.recording,
        },
    )


if __name__ == "__main__":
    main()
