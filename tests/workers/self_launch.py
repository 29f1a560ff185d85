"""``Trainer(strategy=HorovodStrategy(), accelerator="cpu", devices=2)``: run by plain python or by horovodrun.

    python self_launch.py --out DIR [--fail-rank R] [--kill-rank R] [--others-sleep]

Started as one plain process it starts its second worker itself; under ``horovodrun -np 2`` it
is one of the two. Each rank writes ``rank<R>.json`` after training (its final parameters) and
``pid<R>.txt`` when training starts. ``--fail-rank R`` makes rank R raise in its third training
step, ``--kill-rank R`` makes it SIGKILL itself there; with ``--others-sleep`` the other ranks sleep
for 600 s at that step instead of waiting for rank R in a collective; the launcher's grace before
it ends a rank 0 that outlives a failed worker is cut from 15 s to 2 s, so that case ends quickly.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import lightning.pytorch as pl
from _common import listening_addresses, parse_out, write_result
from lightning.pytorch import Callback
from models import LinearNet, line_data
from torch.utils.data import DataLoader

OUT, _ = parse_out()
parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--others-sleep", action="store_true")
ARGS, _ = parser.parse_known_args()


class Cues(Callback):
    """Writes ``pid<R>.txt`` when training starts (rank 0 also notes the job's listening sockets); ``on_step``
    fails, kills or stalls a rank in the third training step, as the flags say."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (OUT / f"pid{trainer.global_rank}.txt").write_text(str(os.getpid()))
        if trainer.global_rank == 0:  # started by plain python: rank 0 is the job's root, its workers are children
            pl_module.listening = listening_addresses(os.getpid())

    @staticmethod
    def on_step(module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if module.global_step == 2:
            if module.global_rank == ARGS.fail_rank:
                raise RuntimeError(f"rank {module.global_rank} fails on purpose")
            if module.global_rank == ARGS.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if ARGS.others_sleep:
                time.sleep(600)  # outside any collective: only the launcher can end this rank


if __name__ == "__main__":
    import horovod.torch as hvd

    from hvd_plugins.core.backend import runner
    from hvd_plugins.pytorch import HorovodStrategy

    runner.EXIT_GRACE_SECONDS = 2.0  # what is tested is that rank 0 is ended, not the 15 s wait

    model = LinearNet(on_step=Cues.on_step)
    initial = [p.detach().flatten().tolist() for p in model.parameters()]
    trainer = pl.Trainer(
        strategy=HorovodStrategy(),
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Cues()],
    )
    trainer.fit(model, DataLoader(line_data(), batch_size=8))
    write_result(
        OUT,
        trainer.global_rank,
        {
            "rank": hvd.rank(),
            "world_size": trainer.world_size,
            "horovod_size": hvd.size(),
            "local_size": hvd.local_size(),
            "global_step": trainer.global_step,
            "initial": initial,
            "parameters": [p.detach().flatten().tolist() for p in model.parameters()],
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "listening": getattr(model, "listening", []),
        },
    )
