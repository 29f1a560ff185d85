"""Every LightningModule and dataset the tests train, in one place: the worker scripts import them from here.

Plain torch and Lightning only (no Horovod, no hvd_plugins), so the unit tier imports them too, and
the ``pytorch_lightning`` copy of tests/workers rewrites this file with the scripts. Each module
seeds its own initial weights, so two builds of one class start from the same parameters; what a
worker adds to one (fault injection, events, files it writes) is a callback of that worker.
"""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

# ---------------------------------------------------------------------------------------------- regression
REGRESSION_FEATURES = 5


def regression_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = x @ [1, ..., 5] + noise`` in float64 (the strategy checks compare with one process exactly)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, REGRESSION_FEATURES, generator=generator, dtype=torch.float64)
    w = torch.arange(1, REGRESSION_FEATURES + 1, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(n, generator=generator, dtype=torch.float64)
    return x, y.unsqueeze(1)


def noiseless_regression(n: int = 128, batch_size: int = 8) -> DataLoader:
    """``y = x @ [1, ..., 5]`` in float32, unshuffled (the Adasum checks)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, REGRESSION_FEATURES, generator=generator)
    y = x @ torch.arange(1.0, REGRESSION_FEATURES + 1).unsqueeze(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class MseEvaluation(pl.LightningModule):
    """Validation and test log the mean squared error over all ranks; predict returns the outputs."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


class Regression(MseEvaluation):
    """One linear layer; the training loss is logged as ``loss_name`` over all ranks."""

    def __init__(self, lr: float = 0.05, optimizer: str = "sgd", loss_name: str = "train_loss") -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layer = nn.Linear(REGRESSION_FEATURES, 1)
        self.lr = lr
        self.optimizer_name = optimizer
        self.loss_name = loss_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log(self.loss_name, loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ScheduledRegression(Regression):
    """SGD at 0.01 with a StepLR: what ``scale_lr`` must scale, base rates included."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10)}


class BatchNormRegression(Regression):
    """Regression behind a BatchNorm layer: running statistics that depend on each rank's data."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(REGRESSION_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.norm(x))


class HiddenBatchNormRegression(Regression):
    """BatchNorm after a trainable layer, so backward flows through the synchronized statistics."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.hidden = nn.Linear(REGRESSION_FEATURES, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)
        del self.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.hidden(x))))


class ManualAccumulation(Regression):
    """Manual optimization accumulating as Lightning's docs show it: ``manual_backward`` on every
    micro-batch (no ``no_backward_sync``), a step on every k-th."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizer = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self(x), y) / self.k)
        if (batch_idx + 1) % self.k == 0:
            optimizer.step()
            optimizer.zero_grad()


class TwoHeads(Regression):
    """Regression plus a second head, ``extra``, that starts frozen (see finetuning.UnfreezeExtra).

    ``extra_in_optimizer``: both heads in the optimizer from the start, ``extra`` frozen until it is made
    trainable in place; otherwise only ``layer``, and ``extra`` joins as a param group.
    """

    def __init__(self, extra_in_optimizer: bool = True, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.extra = nn.Linear(REGRESSION_FEATURES, 1)
        self.extra_in_optimizer = extra_in_optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) + self.extra(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        parameters = self.parameters() if self.extra_in_optimizer else self.layer.parameters()
        return torch.optim.SGD(parameters, lr=self.lr)


class UnfrozenBehindTheStrategysBack(TwoHeads):
    """Manual optimization that makes ``extra`` trainable at step 2 and calls ``loss.backward()`` itself, so the
    strategy hears of the new trainable layer only when the step averages the gradients."""

    def __init__(self) -> None:
        super().__init__(extra_in_optimizer=True)
        self.extra.requires_grad_(False)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizer = self.optimizers()
        if self.global_step == 2:
            self.extra.requires_grad_(True)
        nn.functional.mse_loss(self(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


class TwoSchedules(TwoHeads):
    """Two SGD optimizers of one class, each with a StepLR (manual optimization, as two optimizers need)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        optimizers = self.optimizers()
        loss = nn.functional.mse_loss(self(x), y)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        return loss

    def configure_optimizers(self) -> Any:
        first = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        second = torch.optim.SGD(self.extra.parameters(), lr=0.2)
        steps = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) for optimizer in (first, second)]
        return [first, second], steps


class Gan(pl.LightningModule):
    """Manual optimization with two optimizers over one model; ``toggle=False`` is the plain DDP-style loop."""

    def __init__(self, toggle: bool) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.toggle = toggle
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, REGRESSION_FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(REGRESSION_FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real = batch[0]
        opt_g, opt_d = self.optimizers()
        noise = torch.randn(len(real), 3, dtype=real.dtype, generator=torch.Generator().manual_seed(batch_idx))
        ones, zeros = torch.ones(len(real), 1, dtype=real.dtype), torch.zeros(len(real), 1, dtype=real.dtype)
        bce = nn.functional.binary_cross_entropy_with_logits
        if self.toggle:
            self.toggle_optimizer(opt_g)
        opt_g.zero_grad()
        g_loss = bce(self.discriminator(self.generator(noise)), ones)  # also produces discriminator gradients
        self.manual_backward(g_loss)
        opt_g.step()
        if self.toggle:
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
        opt_d.zero_grad()  # drops the discriminator gradients of the generator's backward
        fake = self.generator(noise).detach()
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        if self.toggle:
            self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        )


class MetricClassifier(pl.LightningModule):
    """Validation only: a torchmetrics accuracy over three classes, logged as ``val_acc``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.layer = nn.Linear(REGRESSION_FEATURES, 3)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.accuracy(self.layer(batch[0]).argmax(dim=1), batch[1])
        self.log("val_acc", self.accuracy, on_epoch=True)


# ---------------------------------------------------------------------------------------------- small nets
class TinyRegression(pl.LightningModule):
    """One linear layer, mean squared error; ``warning`` is warned at every training step."""

    def __init__(self, features: int = 4, outputs: int = 1, lr: float = 0.05, warning: str | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(features, outputs)
        self.lr = lr
        self.warning = warning

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.warning is not None:
            warnings.warn(self.warning, UserWarning, stacklevel=1)
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_mse", nn.functional.mse_loss(self.layer(batch[0]), batch[1]), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def line_data(n: int = 64) -> TensorDataset:
    """``y = x @ [1, -2, 0.5]`` for LinearNet."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=generator)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]))


StepHook = Callable[[pl.LightningModule, Any, int], None]
"""``on_step(module, batch, batch_idx)``, called first in ``training_step``: where a worker injects a fault,
sleeps, or writes an event, at the point of the step the test expects it."""


class LinearNet(pl.LightningModule):
    """Three inputs, one output, SGD at 0.1; the loss is logged as ``loss`` over all ranks."""

    def __init__(self, on_step: StepHook | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)
        self.on_step = on_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step(self, batch, batch_idx)
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TanhRegressor(pl.LightningModule):
    """6 -> 16 -> 1 with tanh, SGD at 0.05 (the two-level allreduce checks count its 129 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class WideTanhRegressor(TanhRegressor):
    """135,169 float64 parameters: one 1.08 MB gradient bucket, at least the 1 MiB that route tuning times."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 1))


class BatchNormClassifier(pl.LightningModule):
    """32 -> 64 -> 4 with BatchNorm, cross-entropy, SGD at 0.1; the loss is logged as ``loss`` (the GPU checks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TanhClassifier(pl.LightningModule):
    """8 -> 16 -> 2 with tanh, SGD with momentum (the Slurm jobs); remembers the step its fit started from."""

    def __init__(self, on_step: StepHook | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.on_step = on_step
        self.started_at_step = -1

    def on_train_start(self) -> None:
        self.started_at_step = self.trainer.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step(self, batch, batch_idx)
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


SPARSE_ROWS = 40


def sparse_lookups(samples: int = 32, lookups: int = 4) -> TensorDataset:
    """``lookups`` embedding rows per sample, and a float64 target, for SparseRegression."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, SPARSE_ROWS, (samples, lookups), generator=generator)
    targets = torch.randn(samples, 1, generator=generator, dtype=torch.float64)
    return TensorDataset(rows, targets)


class SparseRegression(pl.LightningModule):
    """A sparse embedding (its gradients are sparse tensors) and a linear head, float64, SGD at 0.5."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(SPARSE_ROWS, 3, sparse=True).double()
        self.head = nn.Linear(3, 1).double()

    def forward(self, lookups: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(lookups).mean(dim=1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        lookups, targets = batch
        return nn.functional.mse_loss(self(lookups), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


# ---------------------------------------------------------------------------------------------- faults
FAULT_FEATURES = 6


def fault_data(n: int = 256) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, FAULT_FEATURES, generator=generator)
    y = (x @ torch.linspace(-1.0, 1.0, FAULT_FEATURES)).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def fault_loader(n: int = 256, batch_size: int = 8) -> DataLoader:
    return DataLoader(fault_data(n), batch_size=batch_size, shuffle=True)


class FaultNet(pl.LightningModule):
    """Two linear layers, no dropout; ``on_step(module, batch_idx)`` lets a worker inject a fault inside
    training_step (a returned tensor scales the loss)."""

    def __init__(
        self,
        hidden: int = 8,
        optimizers: int = 1,
        on_step: Callable[[FaultNet, int], torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.first = nn.Linear(FAULT_FEATURES, hidden)
        self.second = nn.Linear(hidden, 1)
        self.optimizer_count = optimizers
        self.on_step = on_step
        self.automatic_optimization = optimizers == 1
        self.epoch_losses: dict[int, float] = {}  # epoch -> mean training loss over all ranks
        self._losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.on_step is not None:
            factor = self.on_step(self, batch_idx)
            if factor is not None:
                loss = loss * factor
        self._losses.append(loss.detach())
        if not self.automatic_optimization:
            for optimizer in self.optimizers():
                optimizer.zero_grad()
            self.manual_backward(loss)
            for optimizer in self.optimizers():
                optimizer.step()
        return loss

    def on_train_epoch_end(self) -> None:
        mean = torch.stack(self._losses).mean()
        self._losses.clear()
        self.epoch_losses[self.current_epoch] = float(self.trainer.strategy.reduce(mean, reduce_op="mean"))

    def configure_optimizers(self) -> Any:
        if self.optimizer_count == 1:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [torch.optim.SGD(self.first.parameters(), lr=0.05), torch.optim.SGD(self.second.parameters(), lr=0.05)]


class KillWhilePickled:
    """Pickling this object (inside torch.save, mid-file) kills the process, as a crash mid-write would."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        return (int, ())


class CrashWhileSaving(FaultNet):
    """FaultNet whose checkpoint of epoch ``epoch`` kills the process while it is being written."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.crash_epoch = epoch

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.current_epoch == self.crash_epoch:
            checkpoint["zz_crash"] = KillWhilePickled()  # pickled after the weights


# ---------------------------------------------------------------------------------------------- DASO
DASO_BATCH_SIZE = 16
DASO_FEATURES, DASO_CLASSES = 20, 4


def noisy_classification() -> TensorDataset:
    """1024 samples, 10 % of the labels flipped: the loss floors well above zero, so losses compare."""
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=1024,
        n_features=DASO_FEATURES,
        n_informative=10,
        n_classes=DASO_CLASSES,
        flip_y=0.1,
        class_sep=1.5,
        random_state=0,
    )
    return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))


class Stream(IterableDataset):
    """64 samples of noisy_classification as an IterableDataset without ``__len__``: Lightning cannot know
    how many batches a rank has."""

    def __iter__(self) -> Any:
        x, y = noisy_classification().tensors
        return iter(zip(x[:64], y[:64], strict=True))


class MlpClassifier(pl.LightningModule):
    """A tiny MLP; ``node_zero_branch`` adds a layer only node 0 uses (no gradient on the others),
    ``frozen_extra`` a layer that starts frozen (see finetuning.UnfreezeExtra)."""

    def __init__(self, optimizer: str, batchnorm: bool, node_zero_branch: bool = False, frozen_extra: bool = False):
        super().__init__()
        self.optimizer_name = optimizer
        norm: list[nn.Module] = [nn.BatchNorm1d(32)] if batchnorm else []
        self.net = nn.Sequential(nn.Linear(DASO_FEATURES, 32), *norm, nn.ReLU(), nn.Linear(32, DASO_CLASSES))
        self.node_zero_branch = node_zero_branch
        self.extra = nn.Linear(DASO_FEATURES, DASO_CLASSES) if node_zero_branch or frozen_extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.extra is not None and (not self.node_zero_branch or self.trainer.strategy.topology.node_index == 0):
            out = out + self.extra(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(trainable, lr=1e-2)
        return torch.optim.SGD(trainable, lr=0.1)


class TwoOptimizerClassifier(MlpClassifier):
    """Manual optimization with one optimizer per layer, both stepped every batch."""

    def __init__(self) -> None:
        super().__init__("adam", batchnorm=False)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.net[0].parameters(), lr=1e-2), torch.optim.SGD(self.net[-1].parameters(), lr=0.1)]


# ---------------------------------------------------------------------------------------------- elastic
ELASTIC_SAMPLES, ELASTIC_FEATURES = 480, 8


class IndexedData(Dataset):
    """Regression samples that carry their own index, so the test can count who trained what."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(ELASTIC_SAMPLES, ELASTIC_FEATURES, generator=generator)
        noise = 0.1 * torch.randn(ELASTIC_SAMPLES, generator=generator)
        self.y = self.x @ torch.linspace(-1, 1, ELASTIC_FEATURES) + noise

    def __len__(self) -> int:
        return ELASTIC_SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class ElasticRegressor(pl.LightningModule):
    """8 -> 16 -> 1 with BatchNorm, Adam with a StepLR, on IndexedData (the index is not trained on).

    The first layer has no bias: BatchNorm takes the mean out, so its gradient would be rounding noise, which
    Adam turns into steps of the full learning rate, and runs that add in another order would part ways there."""

    def __init__(self, on_step: StepHook | None = None) -> None:
        super().__init__()
        first = nn.Linear(ELASTIC_FEATURES, 16, bias=False)
        self.net = nn.Sequential(first, nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.on_step = on_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step(self, batch, batch_idx)
        x, y, _ = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)]
