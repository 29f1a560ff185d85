"""Sparse embedding gradients under HorovodStrategy equal DDP's: one process on the global batch.

Each rank trains an ``nn.Embedding(sparse=True)`` model on its shard for two epochs with every
variant below, and compares the parameters with one process that steps on the union of the
workers' batches (the mean loss over the global batch is the mean of the workers' means, which is
what DDP and Horovod average). Float64 throughout, so the match is exact up to rounding.
"""

from __future__ import annotations

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import parse_out, write_result
from models import SparseRegression, sparse_lookups
from torch.utils.data import DataLoader, DistributedSampler

from hvd_plugins.core.backend.waits import synchronize_sleeps
from hvd_plugins.pytorch import HorovodStrategy

OUT, _ = parse_out()
BATCH, EPOCHS = 4, 2
VARIANTS = {
    "sparse_allgather": {"sync": "allreduce", "sparse_as_dense": False},
    "sparse_as_dense": {"sync": "allreduce", "sparse_as_dense": True},
    "hierarchical": {"sync": "hierarchical", "sparse_as_dense": False},
}


def reference(workers: int) -> dict[str, torch.Tensor]:
    """One process, stepping on the union of the workers' batches: the split of the DistributedSampler the
    Trainer gives each worker of a training loader (shuffled with seed 0, reshuffled every epoch), as under DDP."""
    model = SparseRegression()
    optimizer = model.configure_optimizers()
    dataset = sparse_lookups()
    for epoch in range(EPOCHS):
        shards = []
        for rank in range(workers):
            sampler = DistributedSampler(dataset, num_replicas=workers, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), BATCH):
            rows = [index for shard in shards for index in shard[start : start + BATCH]]
            lookups, targets = dataset[rows]
            optimizer.zero_grad()
            model.training_step((lookups, targets), 0).backward()
            optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def trained(settings: dict[str, object]) -> dict[str, torch.Tensor]:
    model = SparseRegression()
    trainer = pl.Trainer(
        strategy=HorovodStrategy(**settings),
        accelerator="cpu",
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(sparse_lookups(), batch_size=BATCH, shuffle=False))
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def main() -> None:
    report: dict[str, object] = {}
    expected = None
    for name, settings in VARIANTS.items():
        try:
            parameters = trained(settings)
            expected = expected or reference(hvd.size())
            report[name] = {
                "max_diff": max((parameters[key] - expected[key]).abs().max().item() for key in expected),
                "embedding_moved": (parameters["embedding.weight"] - SparseRegression().embedding.weight)
                .abs()
                .max()
                .item(),
            }
        except Exception as error:  # recorded, so the other variants still report
            report[name] = {"error": f"{type(error).__name__}: {error}"}
    report["horovod_file"] = hvd.__file__
    report["synchronize_sleeps"] = synchronize_sleeps()
    report["size"] = hvd.size()
    write_result(OUT, hvd.rank(), report)


if __name__ == "__main__":
    main()
