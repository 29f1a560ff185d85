"""A DASO run resumed from a checkpoint taken mid-cycling continues exactly like an uninterrupted run.

    horovodrun -np 2 -H localhost:1,127.0.0.1:1 --gloo python tests/workers/daso_resume.py --out DIR

The test suite runs it inside tests/workers/daso_checks.py (``resume_mid_cycling``). No
DasoScheduleCallback is passed: the strategy itself saves and restores the schedule. The script calls
``hvd.init()`` itself, before any Trainer, without dynamic process sets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
from _common import Checks, parse_out, write_result
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from models import DASO_BATCH_SIZE, MlpClassifier, noisy_classification
from torch.utils.data import DataLoader

from hvd_plugins.pytorch import HorovodStrategy

EPOCHS = 7
STOP_AFTER_EPOCH = 3  # 0-based: epochs 1-5 cycle, so the interrupted run stops in the middle of cycling
# A plateau on every 2nd non-improving epoch: the run stops with one bad epoch counted, which the
# resumed run must remember for epoch 4 to shrink the skips as the uninterrupted run does.
DASO = {"warmup_epochs": 1, "cooldown_epochs": 1, "stable_epochs": 1, "stability_level": 0.5, "cycling": "always"}


class StopAfterEpoch(Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def fit(checkpoints: Path | None = None, stop_after: int | None = None, ckpt_path: Path | None = None) -> dict:
    seed_everything(0)
    model = MlpClassifier("adam", batchnorm=True)
    callbacks: list[Callback] = []
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, save_last=True, save_top_k=0))
    if stop_after is not None:
        callbacks.append(StopAfterEpoch(stop_after))
    trainer = Trainer(
        strategy=HorovodStrategy(sync="daso", daso=DASO),
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        limit_train_batches=6,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpoints is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(noisy_classification(), batch_size=DASO_BATCH_SIZE, shuffle=True)
    daso_sync: dict[str, Any] = {}

    class KeepDaso(Callback):
        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            daso_sync["schedule"] = trainer.strategy.daso_sync.schedule

    trainer.callbacks.append(KeepDaso())
    trainer.fit(model, data, ckpt_path=ckpt_path)
    schedule = daso_sync["schedule"]
    return {
        "history": [(r.epoch, r.phase.value, r.global_skips, r.batches_to_wait, r.loss) for r in schedule.history],
        "parameters": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def resume_matches_uninterrupted(out: Path) -> dict[str, Any]:
    whole = fit()
    checkpoints = out / "checkpoints"
    first = fit(checkpoints=checkpoints, stop_after=STOP_AFTER_EPOCH)
    resumed = fit(ckpt_path=checkpoints / "last.ckpt")
    return {
        "whole_history": whole["history"],
        "interrupted_history": first["history"],
        "resumed_history": resumed["history"],
        "max_parameter_diff": float((whole["parameters"] - resumed["parameters"]).abs().max()),
        "interrupted_vs_whole_diff": float((whole["parameters"] - first["parameters"]).abs().max()),
    }


def main() -> None:
    out, _ = parse_out()
    hvd.init()  # as Horovod's docs start a script; the strategy keeps it
    checks = Checks()

    @checks.register
    def resume_mid_cycling() -> dict[str, Any]:
        return resume_matches_uninterrupted(out)

    write_result(out, hvd.rank(), checks.run())


if __name__ == "__main__":
    main()
