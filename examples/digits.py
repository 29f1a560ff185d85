r"""Classify scikit-learn's bundled 8x8 digits with a small MLP: Lightning's Trainer on HorovodStrategy.

    horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py --compression fp16 --epochs 15
    python examples/digits.py --devices 2                   # starts its 2 workers itself
    python examples/digits.py                               # one process
    mpirun -np 2 --bind-to none python examples/digits.py   # OpenMPI starts the workers (Horovod built with MPI)
    srun --mpi=pmix python examples/digits.py               # inside a Slurm job: see examples/slurm/*.sbatch

    # two emulated nodes of 2 workers: DASO syncs every step inside a node, every few steps across
    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/digits.py --sync daso \
        --daso-warmup-epochs 2 --daso-cooldown-epochs 2 --epochs 12 --monitor

Rank 0 prints the validation accuracy over every worker's share of the validation set, writes the CSV
log to ``<out-dir>/logs/metrics.csv`` and plots it to ``<out-dir>/digits.png``. ``examples/cli.py``
imports DigitsData and DigitsClassifier from here, so the training runs only under ``__main__``.
"""

from __future__ import annotations

import argparse
import csv
import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from matplotlib.figure import Figure
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from hvd_plugins.pytorch import HorovodStrategy
from hvd_plugins.pytorch.callbacks import CommunicationMonitor, DasoScheduleCallback, HorovodTimeline, PeakMemoryMonitor

# 1. Settings. Read only when run as a script; the DASO flags override DasoConfig's defaults.
parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--epochs", type=int, default=15, help="training epochs")
parser.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
parser.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
parser.add_argument(
    "--precision",
    default="32-true",
    choices=["32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"],
    help="Trainer precision",
)
parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none", help="gradients on the wire")
parser.add_argument(
    "--sync",
    choices=["allreduce", "hierarchical", "daso"],
    default="allreduce",
    help="flat allreduce; node, then across nodes; or DASO",
)
parser.add_argument(
    "--shard",
    choices=["none", "optimizer", "gradients", "parameters"],
    default="none",
    help="split the optimizer state (ZeRO-1), the gradients too (ZeRO-2), and the parameters (ZeRO-3)",
)
daso_flags = parser.add_argument_group("DASO, only with --sync daso (unset: DasoConfig's default)")
daso_flags.add_argument("--daso-warmup-epochs", type=int, help="synchronous epochs at the start")
daso_flags.add_argument("--daso-cooldown-epochs", type=int, help="synchronous epochs at the end")
daso_flags.add_argument("--daso-max-global-skips", type=int, help="most batches between two cross-node syncs")
daso_flags.add_argument("--daso-downcast", choices=["fp16", "bf16", "fp32"], help="cross-node wire type")
parser.add_argument("--devices", type=int, default=1, help="workers to start from plain python")
parser.add_argument("--compile", action="store_true", help="compile the model's forward (on the first steps)")
parser.add_argument("--monitor", action="store_true", help="peak memory and traffic per epoch: tables, CSV columns")
parser.add_argument(
    "--timeline-steps",
    nargs=2,
    type=int,
    metavar=("START", "STOP"),
    help="record a Horovod timeline of these optimizer steps to <out-dir>/timeline.json",
)
parser.add_argument("--out-dir", type=Path, default=Path("runs"), help="where the CSV log and the plot go")
parser.add_argument("--no-progress-bar", action="store_true", help="no progress bar (the CSV log stays)")
parser.add_argument("--seed", type=int, default=0, help="seed of the split, the weights and the shuffling")

warnings.filterwarnings("ignore", ".*does not have many workers.*")  # tiny in-memory data: no loader workers


# 2. Data: 1797 images as 64 features in [0, 1]; 360 held out (a multiple of 1..6 and 8 workers, so the
#    DistributedSampler Lightning adds pads nothing and the accuracy counts every image once).
class DigitsData(LightningDataModule):
    """The digits split as a DataModule, so LightningCLI (examples/cli.py) can configure it too."""

    def __init__(self, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        images, labels = load_digits(return_X_y=True)
        x_train, x_val, y_train, y_val = train_test_split(
            images / 16.0, labels, test_size=360, stratify=labels, random_state=seed
        )
        self.train_set = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
        self.val_set = TensorDataset(torch.tensor(x_val, dtype=torch.float32), torch.tensor(y_val))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


# 3. Model: 64 -> 128 -> 10 with BatchNorm and dropout.
class DigitsClassifier(LightningModule):
    """Logs loss and accuracy per epoch; the metrics are reduced over all workers, not one shard."""

    def __init__(self, lr: float = 2e-3, hidden: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 10)
        )
        # HorovodStrategy syncs torchmetrics over every worker before compute().
        self.train_accuracy = MulticlassAccuracy(10, average="micro")
        self.val_accuracy = MulticlassAccuracy(10, average="micro")

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


if __name__ == "__main__":
    args = parser.parse_args()
    daso = {key.removeprefix("daso_"): value for key, value in vars(args).items() if key.startswith("daso_")}
    daso = {key: value for key, value in daso.items() if value is not None}  # the DASO flags given
    if daso and args.sync != "daso":
        given = ", ".join("--daso-" + key.replace("_", "-") for key in daso)
        parser.error(f"{given}: DASO settings need --sync daso (this run has --sync {args.sync})")

    # 4. The Trainer on HorovodStrategy. Under horovodrun, mpirun or srun every process is one worker;
    #    from plain python, --devices N starts the other N - 1 workers when fit begins.
    callbacks: list[Callback] = [DasoScheduleCallback()] if args.sync == "daso" else []  # daso/* per epoch
    if args.monitor:
        callbacks += [PeakMemoryMonitor(), CommunicationMonitor()]
    if args.timeline_steps:
        start, stop = args.timeline_steps
        callbacks.append(HorovodTimeline(args.out_dir / "timeline.json", start_step=start, stop_step=stop))
    seed_everything(args.seed, workers=True)
    trainer = Trainer(
        strategy=HorovodStrategy(
            compression=args.compression,
            sync=args.sync,
            shard=args.shard,
            daso=daso if args.sync == "daso" else None,
        ),
        accelerator="auto",
        devices=args.devices,
        max_epochs=args.epochs,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        logger=CSVLogger(args.out_dir, name="", version="logs"),  # <out-dir>/logs/metrics.csv
        enable_progress_bar=not args.no_progress_bar,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )

    # 5. Fit: Lightning gives each worker its share of the data; Horovod averages the gradients.
    model = DigitsClassifier(lr=args.lr)
    if args.compile:  # the forward only: the steps' self.log stays eager, the parameter names stay
        model.forward = torch.compile(model.forward)
    trainer.fit(model, DigitsData(args.batch_size, args.seed))
    accuracy = float(trainer.callback_metrics["val_acc"])  # already reduced over all workers

    # 6. Result, on rank 0: the CSV log per epoch as a plot, then the accuracy.
    if trainer.is_global_zero:
        metrics_csv = args.out_dir / "logs" / "metrics.csv"
        with open(metrics_csv, newline="") as file:
            rows = list(csv.DictReader(file))
        panels = {"loss": ["train_loss", "val_loss"], "accuracy": ["train_acc", "val_acc"]}
        if args.sync == "daso":
            panels["DASO schedule"] = [name for name in rows[0] if name.startswith("daso/")]
        figure = Figure(figsize=(4.5 * len(panels), 3.6), layout="tight")
        for axis, (title, names) in zip(figure.subplots(1, len(panels)), panels.items(), strict=True):
            for name in names:
                by_epoch = {int(row["epoch"]): float(row[name]) for row in rows if row.get(name)}
                axis.plot(list(by_epoch), list(by_epoch.values()), marker="o", markersize=3, label=name)
            axis.set(title=title, xlabel="epoch")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        figure.suptitle(f"digits MLP: {trainer.world_size} worker(s), compression={args.compression}, sync={args.sync}")
        figure.savefig(args.out_dir / "digits.png", dpi=110)
        print(f"log: {metrics_csv}")
        print(f"plot: {args.out_dir / 'digits.png'}")
        print(f"validation accuracy: {accuracy:.4f}")
