"""Classify scikit-learn's bundled 8x8 digits with a small MLP, data-parallel over Horovod.

    horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py --compression fp16 --epochs 15
    python examples/digits.py                       # the same script as one plain process

Rank 0 prints the validation accuracy over ALL workers' shards at the end, writes the CSV log to
``<out-dir>/logs/metrics.csv`` and a plot of loss/accuracy per epoch to ``<out-dir>/digits.png``.
"""

from __future__ import annotations

import argparse

import torch
from common import (
    add_strategy_flags,
    add_training_flags,
    build_trainer,
    describe_run,
    plot_run,
)
from lightning.pytorch import LightningDataModule, LightningModule, seed_everything
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

NUM_CLASSES = 10
VALIDATION_SIZE = 360  # divisible by 1..6 and 8 workers, so the distributed sampler pads nothing


def digits_datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The 1797 bundled images as 64 features scaled to [0, 1]; a stratified hold-out split."""
    images, labels = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        images / 16.0, labels, test_size=VALIDATION_SIZE, stratify=labels, random_state=seed
    )

    def as_dataset(x, y) -> TensorDataset:
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))

    return as_dataset(x_train, y_train), as_dataset(x_val, y_val)


class DigitsData(LightningDataModule):
    """The digits split as a DataModule (used by the LightningCLI entry, examples/cli.py)."""

    def __init__(self, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_set, self.val_set = digits_datasets(seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class DigitsClassifier(LightningModule):
    """64 -> 128 -> 10 MLP with BatchNorm (so --sync-batchnorm has something to sync)."""

    def __init__(self, lr: float = 2e-3, hidden: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, NUM_CLASSES),
        )
        # HorovodStrategy syncs these over every worker before compute(), not just this shard.
        self.train_accuracy = MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_accuracy = MulticlassAccuracy(NUM_CLASSES, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_accuracy(logits, y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("train_acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_accuracy(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self.log("val_acc", self.val_accuracy, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_flags(parser, epochs=15, batch_size=32, lr=2e-3)
    add_strategy_flags(parser)
    args = parser.parse_args()

    seed_everything(args.seed, workers=True)
    trainer = build_trainer(args)  # starts Horovod; Lightning adds the DistributedSamplers
    trainer.fit(DigitsClassifier(lr=args.lr), DigitsData(args.batch_size, args.seed))

    accuracy = float(trainer.callback_metrics["val_acc"])  # already reduced over all workers
    if trainer.is_global_zero:
        metrics_csv = args.out_dir / "logs" / "metrics.csv"
        plot = plot_run(
            metrics_csv,
            args.out_dir / "digits.png",
            f"digits MLP: {describe_run(args, trainer.world_size)}",
            {"loss": ["train_loss", "val_loss"], "accuracy": ["train_acc", "val_acc"]},
        )
        print(f"log: {metrics_csv}")
        print(f"plot: {plot}")
        print(f"validation accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
