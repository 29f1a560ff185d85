"""HorovodStrategy on GPUs: NCCL allreduce, cuda:<local_rank>, fp16 AMP with a GradScaler."""

from __future__ import annotations

import hashlib
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks, parse_out, write_result
from models import BatchNormClassifier
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy

checks = Checks()


def fit(precision: str, compression: str) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=generator)
    y = (x[:, :4].argmax(dim=1)).long()
    model = BatchNormClassifier()
    trainer = pl.Trainer(
        strategy=HorovodStrategy(compression=compression),
        sync_batchnorm=True,
        accelerator="gpu",
        devices=1,
        precision=precision,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32))
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {
        "device": str(trainer.strategy.root_device),
        "local_rank": hvd.local_rank(),
        "loss": float(trainer.callback_metrics["loss"]),
        "digests": hvd.allgather_object(digest),
        "bytes": trainer.strategy.comm_counters.cross_node_bytes + trainer.strategy.comm_counters.node_local_bytes,
    }


@checks.register
def fp32() -> dict[str, Any]:
    return fit("32-true", "none")


@checks.register
def amp_fp16_compressed() -> dict[str, Any]:
    return fit("16-mixed", "fp16")


if __name__ == "__main__":
    OUT, _ = parse_out()
    hvd.init()
    write_result(OUT, hvd.rank(), checks.run())
