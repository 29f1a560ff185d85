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
import torch
from _common import listening_addresses, parse_out, write_result
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OUT, _ = parse_out()
parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--others-sleep", action="store_true")
ARGS, _ = parser.parse_known_args()


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)

    def on_train_start(self) -> None:
        (OUT / f"pid{self.global_rank}.txt").write_text(str(os.getpid()))
        if self.global_rank == 0:  # started by plain python: rank 0 is the job's root, its workers are children
            self.listening = listening_addresses(os.getpid())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 2:
            if self.global_rank == ARGS.fail_rank:
                raise RuntimeError(f"rank {self.global_rank} fails on purpose")
            if self.global_rank == ARGS.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if ARGS.others_sleep:
                time.sleep(600)  # outside any collective: only the launcher can end this rank
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    import horovod.torch as hvd

    from hvd_plugins.core.backend import runner
    from hvd_plugins.pytorch import HorovodStrategy

    runner.EXIT_GRACE_SECONDS = 2.0  # what is tested is that rank 0 is ended, not the 15 s wait

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    model = Net()
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
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
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
