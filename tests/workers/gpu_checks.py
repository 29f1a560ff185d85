"""HorovodStrategy on GPUs: NCCL allreduce, cuda:<local_rank>, fp16 AMP with a GradScaler, bfloat16 end to end."""

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


def fit(precision: str, compression: str, accelerator: str = "gpu") -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=generator)
    y = (x[:, :4].argmax(dim=1)).long()
    model = BatchNormClassifier()
    trainer = pl.Trainer(
        strategy=HorovodStrategy(compression=compression),
        sync_batchnorm=True,
        accelerator=accelerator,
        devices=1,
        precision=precision,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32))
    digest = hashlib.sha256(
        b"".join(p.detach().cpu().float().numpy().tobytes() for p in model.parameters())
    ).hexdigest()
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


@checks.register
def bf16_true() -> dict[str, Any]:
    return fit("bf16-true", "none")


@checks.register
def bf16_mixed_bf16_wire() -> dict[str, Any]:
    return fit("bf16-mixed", "bf16")


@checks.register
def bf16_collectives() -> dict[str, bool]:
    """NCCL's bfloat16 paths and the CUDA bfloat16 scaling kernels (one buffer, and several fused), exactly.

    Every rank sends the same values, so with a power-of-two number of workers each expected result is exact."""
    size = hvd.size()
    device = torch.device("cuda", hvd.local_rank())
    x = torch.randn(1001, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    pieces = [x, x[:77], x[:5]]
    results = {
        "sum": (hvd.allreduce(x, op=hvd.Sum, name="gpu.sum"), x * size),
        "average": (hvd.allreduce(x, op=hvd.Average, name="gpu.avg"), x),
        "scaled": (
            hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0, name="gpu.scaled"),
            x * 2 * size,
        ),
        "fused_scaled": (
            torch.cat(hvd.grouped_allreduce(pieces, op=hvd.Sum, prescale_factor=0.5, name="gpu.fused")),
            torch.cat(pieces) * 0.5 * size,
        ),
        "max": (hvd.allreduce(x, op=hvd.Max, name="gpu.max"), x),
        "allgather": (hvd.allgather(x[None], name="gpu.gather"), x[None].expand(size, -1)),
        "broadcast": (hvd.broadcast(x, root_rank=0, name="gpu.bcast"), x),
        "alltoall": (hvd.alltoall(x[: 10 * size], name="gpu.a2a"), x[:10].repeat(size)),
        "reducescatter": (
            hvd.reducescatter(x[: 10 * size], op=hvd.Sum, name="gpu.rs"),
            x[10 * hvd.rank() : 10 * hvd.rank() + 10] * size,
        ),
    }
    return {
        name: bool(got.dtype == torch.bfloat16 and got.device == device and torch.equal(got, expected))
        for name, (got, expected) in results.items()
    }


if __name__ == "__main__":
    OUT, _ = parse_out()
    hvd.init()
    write_result(OUT, hvd.rank(), checks.run())
