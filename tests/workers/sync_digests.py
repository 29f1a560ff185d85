"""Digests of what the two-level allreduce, the two-level sync and DASO compute, held bit for bit.

Run under ``horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo``. Every input is made from integers by
divisions, which IEEE arithmetic rounds the same way on every CPU, and the model's gradients are
elementwise (``2 (w - x)``), so a digest changes only when the sums themselves change: their order,
their wire types, their buckets. ``tests/test_sync_digests.py`` compares them with stored ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks, parse_out, write_result
from strategy_common import trainer as strategy_trainer
from torch import nn
from torch.utils.data import Dataset

from hvd_plugins.core.comm import (
    CommCounters,
    FP16Compression,
    build_node_groups,
    discover_topology,
    hierarchical_allreduce_,
)
from hvd_plugins.pytorch import HorovodStrategy

checks = Checks()
SHAPES = ((64, 33), (257,), (7,))
"""The model's parameters: with a 10 kB bucket the first fills one bucket and the other two a second."""


def order_sensitive(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` values that differ per rank and seed, whose sums depend on their order (thirds, sevenths...)."""
    index = torch.arange(n, dtype=torch.int64)
    numerators = (index * 2654435761 + seed * 40503 + hvd.rank() * 7919) % 100003 - 50001
    return (numerators.to(torch.float64) / (3 * 7 * 11 * 13)).to(dtype)


def sha(tensors: Sequence[torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(str(tensor.dtype).encode())
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


@checks.register
def check_two_level_sums() -> dict[str, str]:
    """``hierarchical_allreduce_`` on buffers of several sizes and types, with and without fp16 on the wire."""
    groups = build_node_groups(discover_topology())
    cases: dict[str, dict[str, Any]] = {
        "fp32": {},
        "fp32_fp16_wire": {"compression": FP16Compression()},
        "fp32_fp16_everywhere": {"compression": FP16Compression(), "compress_node_local": True},
        "fp32_flat_below": {"flat_below_bytes": 4000},
        "fp32_sum": {"average": False},
    }
    digests = {}
    for seed, (name, options) in enumerate(cases.items()):
        buffers = [order_sensitive(n, seed) for n in (5, 999, 4096, 100_001)]
        hierarchical_allreduce_(buffers, groups, counters=CommCounters(), name=f"digest.{name}", **options)
        digests[name] = sha(buffers)
    mixed = [order_sensitive(1001, 9, torch.float64), order_sensitive(3, 10, torch.float16)]
    hierarchical_allreduce_(mixed, groups, name="digest.mixed")
    digests["fp64_fp16"] = sha(mixed)
    return digests


class Targets(Dataset):
    """One target per parameter and sample, different on every rank's share."""

    def __init__(self, samples: int = 48) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(
            order_sensitive(int(torch.Size(shape).numel()), 100 * index + part).view(shape)
            for part, shape in enumerate(SHAPES)
        )


class Quadratic(pl.LightningModule):
    """``sum((w - x)^2) / 1024`` over three parameters: elementwise gradients, a loss that falls."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(shape)) for shape in SHAPES)
        self.optimizer = optimizer

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = sum(((w - x) ** 2).mean(dim=0).sum() for w, x in zip(self.weights, batch, strict=True)) / 1024
        self.log("loss", loss)
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Targets(), batch_size=4, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def fit_digest(strategy: HorovodStrategy, optimizer: str, epochs: int, accumulate: int = 1) -> str:
    model = Quadratic(optimizer)
    trainer = strategy_trainer(
        strategy=strategy, precision="32-true", max_epochs=epochs, accumulate_grad_batches=accumulate
    )
    trainer.fit(model)
    optimizer_state = trainer.optimizers[0].state_dict()["state"]
    moments = [value for state in optimizer_state.values() for key, value in sorted(state.items()) if key != "step"]
    return sha([*model.parameters(), *moments])


@checks.register
def check_hierarchical_training() -> dict[str, str]:
    """``sync="hierarchical"`` on its two-level legs (no route timing), bucketed, with and without fp16."""
    legs = {"flat_below_mb": 0.0, "bucket_mb": 0.01}
    return {
        "sgd_fp16_accumulated": fit_digest(
            HorovodStrategy(sync="hierarchical", compression="fp16", **legs), "sgd", 2, 2
        ),
        "adam_fp16_node_local": fit_digest(
            HorovodStrategy(sync="hierarchical", compression="fp16", compress_node_local=True, **legs), "adam", 2
        ),
        "sgd_small_buckets_flat": fit_digest(
            HorovodStrategy(sync="hierarchical", flat_below_mb=0.005, bucket_mb=0.01), "sgd", 2
        ),
    }


@checks.register
def check_daso_training() -> dict[str, str]:
    """``sync="daso"`` through warmup, cycling (merges in flight) and cooldown, per wire type and optimizer."""
    schedule = {
        "warmup_epochs": 1,
        "cooldown_epochs": 1,
        "max_global_skips": 2,
        "stable_epochs": 1,
        "cycling": "always",
    }
    return {
        "adam_fp16": fit_digest(HorovodStrategy(sync="daso", daso={**schedule, "downcast": "fp16"}), "adam", 5),
        "sgd_bf16_per_node_state": fit_digest(
            HorovodStrategy(sync="daso", daso={**schedule, "downcast": "bf16", "average_optimizer_state": False}),
            "sgd",
            5,
        ),
        "adam_fp32_accumulated": fit_digest(
            HorovodStrategy(sync="daso", compression="fp16", daso={**schedule, "downcast": "fp32"}), "adam", 5, 2
        ),
    }


if __name__ == "__main__":
    out, args = parse_out()
    hvd.init()
    torch.set_num_threads(1)
    report = checks.selected(args.case).run()
    report["torch"] = torch.__version__
    write_result(out, hvd.rank(), report)
