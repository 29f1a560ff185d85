"""``trainer.fit(torch.compile(model))`` under HorovodStrategy: every sync and shard mode against eager training.

Part of the shared two-worker job (strategy_features.py), so it runs with both Lightning packages and
under the MPI controller. The bulk compiles with dynamo's ``aot_eager`` backend: the same capture, the
same cut at gradient buckets and the same compiled backward pieces as Inductor, without generating
C++ (seconds instead of tens of seconds a graph); one check compiles with Inductor itself.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import MseEvaluation
from strategy_common import all_equal, digest, trainer
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy

checks = Checks()

WIDTH, LAYERS, BATCH = 400, 4, 8
"""Four 400x400 layers: 2.6 MB of float32 parameters, so 1 MiB buckets cut the graph in pieces."""
BUCKET = {"bucket_mb": 1.0}
MODES: dict[str, dict[str, Any]] = {
    "allreduce": {},
    "allreduce_fp16": {"compression": "fp16"},
    "zero1": {"shard": "optimizer"},
    "zero2": {"shard": "gradients"},
    "hierarchical": {"sync": "hierarchical"},
    "hierarchical_zero2": {"sync": "hierarchical", "shard": "gradients"},
    "daso": {"sync": "daso"},
}
"""Every sync and shard value (DASO shards nothing), each trained compiled and eager."""


class DeepMlp(MseEvaluation):
    """A few wide tanh layers (and a BatchNorm), AdamW; no ``self.log`` in the training step: one graph."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        layers: list[nn.Module] = [nn.Linear(8, WIDTH), nn.Tanh()]
        if batchnorm:
            layers.append(nn.BatchNorm1d(WIDTH))
        for _ in range(LAYERS - 1):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        layers.append(nn.Linear(WIDTH, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(samples: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 8, generator=generator)
    return TensorDataset(x, (x[:, :3].sum(1, keepdim=True)).sin())


def loader() -> DataLoader:
    return DataLoader(data(), batch_size=BATCH)  # 64 samples / 2 ranks: 4 even batches a rank


def parameters_of(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


class BackwardOrder(Callback):
    """Records, in one training step, how many parameters had their gradients before the input's was computed.

    With the graph cut, the last piece's backward ends (and hands its parameters' gradients to the sync)
    before the first piece's backward, which computes the input's gradient, has run."""

    def __init__(self) -> None:
        self.ready: list[str] = []
        self.before_input: int | None = None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for name, parameter in module.named_parameters():
            parameter.register_post_accumulate_grad_hook(lambda _, name=name: self.ready.append(name))

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        self.ready.clear()
        x = batch[0]
        if index == 2 and self.before_input is None:
            x.requires_grad_(True)
            x.register_hook(self._input_gradient)

    def _input_gradient(self, grad: torch.Tensor) -> None:
        self.before_input = len(self.ready)


def fit(
    compiled: bool,
    backend: str = "aot_eager",
    callbacks: tuple[Callback, ...] = (),
    batchnorm: bool = False,
    **settings: Any,
) -> tuple[DeepMlp, pl.Trainer, int]:
    """Train ``DeepMlp`` for 2 epochs, compiled or not; returns the model, its Trainer and the pieces compiled."""
    torch._dynamo.reset()  # fresh caches: each fit's model is a new instance
    counters.clear()
    model = DeepMlp(batchnorm)
    given: Any = torch.compile(model, backend=backend) if compiled else model
    precision = settings.pop("precision", "32-true")
    sync_batchnorm = settings.pop("sync_batchnorm", False)
    t = trainer(
        max_epochs=2,
        precision=precision,
        sync_batchnorm=sync_batchnorm,
        strategy=HorovodStrategy(**BUCKET, **settings),
        callbacks=list(callbacks),
    )
    t.fit(given, loader())
    return model, t, int(counters["aot_autograd"]["total"])


@checks.register
def check_compiled_fit_equals_eager() -> dict[str, Any]:
    """Every sync and shard mode: the compiled fit ends where the eager one does, on every rank alike."""
    result: dict[str, Any] = {}
    for name, settings in MODES.items():
        eager, _, _ = fit(False, **settings)
        compiled, t, pieces = fit(True, **settings)
        result[name] = {
            "vs_eager": float((parameters_of(compiled) - parameters_of(eager)).abs().max()),
            "largest": float(parameters_of(eager).abs().max()),
            "ranks_identical": all_equal(digest(compiled)),
            "steps": t.global_step,
            "pieces": pieces,
            "graph_breaks": sum(counters["graph_break"].values()),
        }
    return result


@checks.register
def check_compiled_mixed_precision() -> dict[str, Any]:
    """``bf16-mixed``: compiled and eager train alike (autocast traced into the graph), flat and ZeRO-2."""
    result: dict[str, Any] = {}
    for name, settings in (("allreduce", {}), ("zero2", {"shard": "gradients"})):
        eager, _, _ = fit(False, precision="bf16-mixed", **settings)
        compiled, _, _ = fit(True, precision="bf16-mixed", **settings)
        result[name] = {
            "vs_eager": float((parameters_of(compiled) - parameters_of(eager)).abs().max()),
            "ranks_identical": all_equal(digest(compiled)),
        }
    return result


@checks.register
def check_compiled_graphs_and_overlap() -> dict[str, Any]:
    """Inductor itself: one graph for the training step, no graph break, cut into pieces whose syncs start
    before backward ends; and the sync-BatchNorm layers the strategy puts in add no graph break."""
    order = BackwardOrder()
    eager, _, _ = fit(False, backend="inductor")
    compiled, _, pieces = fit(True, backend="inductor", callbacks=(order,))
    result: dict[str, Any] = {
        "vs_eager": float((parameters_of(compiled) - parameters_of(eager)).abs().max()),
        "largest": float(parameters_of(eager).abs().max()),
        "ranks_identical": all_equal(digest(compiled)),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": dict(counters["graph_break"]),
        "pieces": pieces,
        "ready_before_input_gradient": order.before_input,
        "parameters": len(list(compiled.parameters())),
    }
    sync_eager, _, _ = fit(False, batchnorm=True, sync_batchnorm=True)
    sync_compiled, t, _ = fit(True, batchnorm=True, sync_batchnorm=True)
    result["sync_batchnorm"] = {
        "vs_eager": float((parameters_of(sync_compiled) - parameters_of(sync_eager)).abs().max()),
        "graph_breaks": dict(counters["graph_break"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "ranks_identical": all_equal(digest(sync_compiled)),
    }
    return result


@checks.register
def check_compiled_loops_and_checkpoint() -> dict[str, Any]:
    """validate/test/predict of a compiled model equal eager; its checkpoint holds the uncompiled names and loads
    into an uncompiled model, and into a fit of one that resumes from it."""
    directory = Path(hvd.broadcast_object(tempfile.mkdtemp(prefix="compiled_ckpt_"), root_rank=0))
    torch._dynamo.reset()
    model = DeepMlp()
    t = trainer(
        max_epochs=1,
        precision="32-true",
        strategy=HorovodStrategy(**BUCKET),
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)],
    )
    t.fit(torch.compile(model, backend="aot_eager"), loader())
    evaluated = {}
    for stage in ("validate", "test"):
        metric = "val_loss" if stage == "validate" else "test_loss"
        compiled_loss = getattr(t, stage)(torch.compile(model, backend="aot_eager"), loader())[0][metric]
        eager_loss = getattr(trainer(precision="32-true"), stage)(model, loader())[0][metric]
        evaluated[stage] = (float(compiled_loss), float(eager_loss))
    predicted = t.predict(torch.compile(model, backend="aot_eager"), loader())
    eager_predicted = trainer(precision="32-true").predict(model, loader())
    hvd.barrier()
    checkpoint = torch.load(directory / "last.ckpt", weights_only=False)
    keys = list(checkpoint["state_dict"])
    fresh = DeepMlp()
    fresh.load_state_dict(checkpoint["state_dict"])  # strict: the uncompiled names, all of them
    resumed = trainer(max_epochs=2, precision="32-true", strategy=HorovodStrategy(**BUCKET))
    resumed.fit(DeepMlp(), loader(), ckpt_path=str(directory / "last.ckpt"))
    return {
        "losses": {stage: [compiled_loss, eager_loss] for stage, (compiled_loss, eager_loss) in evaluated.items()},
        "predictions_diff": float(max((a - b).abs().max() for a, b in zip(predicted, eager_predicted, strict=True))),
        "compiled_names": [key for key in keys if "_orig_mod" in key],
        "keys": len(keys),
        "loaded_equal": all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters(), strict=True)),
        "resumed_steps": resumed.global_step,
    }
