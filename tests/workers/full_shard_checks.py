"""Full sharding (``shard="parameters"``, ZeRO-3) against unsharded training, on real workers.

Run under ``horovodrun -np 4 -H localhost:2,127.0.0.1:2`` (two emulated nodes). Every case trains the same
model on the same data twice, unsharded and fully sharded, and reports the largest difference of the
parameters relative to the largest parameter (float32: the order of the sums is the only difference), what
each worker held of the parameters while training, and the checkpoint's whole model.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks, out_dir, parse_out, write_result
from models import regression_data
from strategy_common import trainer as strategy_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy

checks = Checks()
SAMPLES = 320  # 10 steps an epoch on 4 workers of 8 samples: 50 steps in 5 epochs
WIDTH = 16
VOCABULARY = 11


class Block(nn.Module):
    """A residual block: the unit of these models."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)
        self.computed_in: set[str] = set()  # the dtypes its weights had while it computed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.computed_in.add(str(self.inner.weight.dtype))
        return x + self.outer(torch.tanh(self.inner(x)))


class UnitNet(pl.LightningModule):
    """5 -> 16, three Blocks, 16 -> 1; ``frozen``: the stem and the first block frozen (a base with adapters)."""

    def __init__(
        self, optimizer: str = "adamw", scheduler: bool = False, frozen: bool = False, seed: int | None = 3
    ) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.optimizer_name, self.scheduler, self.frozen = optimizer, scheduler, frozen
        self.validated: list[float] = []
        self.build()

    def build(self) -> None:
        self.stem = nn.Linear(5, WIDTH)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(WIDTH, 1)
        if self.frozen:
            for parameter in [*self.stem.parameters(), *self.blocks[0].parameters()]:
                parameter.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.tanh(self.stem(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.validated.append(float(nn.functional.mse_loss(self(x), y)))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def train_dataloader(self) -> DataLoader:
        x, y = regression_data(SAMPLES, seed=5)
        return DataLoader(TensorDataset(x.float(), y.float()), batch_size=8)

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(trainable, lr=0.01, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(trainable, lr=0.01, weight_decay=0.1)
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}


class TorchClippedNet(UnitNet):
    """UnitNet stepped by hand, clipped by ``torch.nn.utils.clip_grad_norm_`` over ``self.parameters()`` between
    ``manual_backward`` and the step, as plain torch code clips."""

    def __init__(self) -> None:
        super().__init__("adamw")
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
        optimizer.step()
        return loss


class ConfiguredNet(UnitNet):
    """UnitNet built in ``configure_model`` (on the meta device when fully sharded), from the seed as it is then."""

    def build(self) -> None:
        """Nothing yet: ``configure_model`` builds."""

    def configure_model(self) -> None:
        if not hasattr(self, "head"):
            super().build()
            self.built_on_meta = any(p.is_meta for p in self.parameters())


class TiedHead(Block):
    """A Block (a unit) that ends in an output head whose weight is another module's."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.head.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))


class TinyLM(pl.LightningModule):
    """Token embedding tied to the output head, two Blocks between: the tied weight is in no one unit (outside
    every unit, or ``into_unit``: in the last Block and in the embedding outside it)."""

    def __init__(self, into_unit: bool = False) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        if into_unit:
            self.blocks = nn.Sequential(Block(), TiedHead(self.embed.weight))
            self.head = nn.Identity()
        else:
            self.blocks = nn.Sequential(Block(), Block())
            self.head = nn.Linear(WIDTH, VOCABULARY, bias=False)
            self.head.weight = self.embed.weight

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.head(self.blocks(self.embed(tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), tokens[:, 1:].reshape(-1))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(6)
        return DataLoader(TensorDataset(torch.randint(0, VOCABULARY, (SAMPLES, 6), generator=generator)), 8)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class HeldParameters(pl.Callback):
    """The parameter elements this worker holds after every training batch (a freed unit holds none)."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.held.append(sum(p.numel() for p in pl_module.parameters()))


def parameters_of(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def fit(shard: str, module: pl.LightningModule, epochs: int = 5, **options: Any) -> tuple[Any, Any, list[int]]:
    names = ("compression", "op", "reshard_after_forward", "param_dtype", "sync", "activation_checkpointing_policy")
    strategy_options = {k: options.pop(k) for k in names if k in options}
    if shard == "parameters" and not options.pop("default_units", False):
        strategy_options["auto_wrap_policy"] = {Block}
    else:
        options.pop("default_units", None)
        strategy_options.pop("reshard_after_forward", None)
        strategy_options.pop("param_dtype", None)
    held, ckpt_path = HeldParameters(), options.pop("ckpt_path", None)
    trainer = strategy_trainer(
        strategy=HorovodStrategy(shard=shard, bucket_mb=0.0005, **strategy_options),
        max_epochs=epochs,
        callbacks=[held],
        **{"precision": "32-true", **options},
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer, held.held


def difference(make: Any, **options: Any) -> dict[str, Any]:
    """The largest |fully sharded - unsharded| over the parameters, relative to the largest unsharded one, and
    the elements each held while training."""
    reference, _, whole = fit("none", make(), **dict(options))
    sharded, _, held = fit("parameters", make(), **dict(options))
    expected = parameters_of(reference)
    blocks = [module for module in sharded.modules() if isinstance(module, Block)]
    return {
        "difference": float((parameters_of(sharded) - expected).abs().max() / expected.abs().max()),
        "held": max(held),
        "held_after_step": min(held),  # every unit freed, the model's own too (embedding, head) after a step
        "frozen": sum(p.numel() for p in sharded.parameters() if not p.requires_grad),
        "whole": max(whole),
        "computed_in": sorted(set().union(*(block.computed_in for block in blocks))),
    }


CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "adamw_scheduler": (lambda: UnitNet("adamw", scheduler=True), {}),
    "sgd_momentum": (lambda: UnitNet("sgd"), {}),
    "clip_norm": (lambda: UnitNet("adamw"), {"gradient_clip_val": 0.05}),
    "clip_value": (lambda: UnitNet("sgd"), {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "torch_clipping_by_hand": (TorchClippedNet, {}),
    "accumulation": (lambda: UnitNet("adamw"), {"accumulate_grad_batches": 2}),
    "bf16_mixed": (lambda: UnitNet("adamw"), {"precision": "bf16-mixed"}),  # "auto": float32 gathers on the CPU
    "bf16_gathers": (lambda: UnitNet("sgd"), {"precision": "bf16-mixed", "param_dtype": "bf16"}),
    "frozen_base": (lambda: UnitNet("adamw", frozen=True), {}),
    "tied_embedding": (TinyLM, {}),
    "tied_into_a_unit": (lambda: TinyLM(into_unit=True), {}),
    "keep_until_backward": (lambda: UnitNet("adamw"), {"reshard_after_forward": False}),
    "activation_checkpointing": (lambda: UnitNet("adamw"), {"activation_checkpointing_policy": {Block}}),
    "hybrid_inside_nodes": (lambda: UnitNet("adamw", scheduler=True), {"sync": "hierarchical"}),
}


@checks.register
def check_equal_to_unsharded() -> dict[str, dict[str, Any]]:
    """Every case, 50 steps: the parameters equal the unsharded run's up to the order of sums."""
    return {case: difference(make, **options) for case, (make, options) in CASES.items()}


@checks.register
def check_a_short_run_equals_unsharded() -> dict[str, Any]:
    """AdamW with a scheduler, clipped by norm, 20 steps: the one equality the job for ``pytorch_lightning`` runs."""
    return difference(lambda: UnitNet("adamw", scheduler=True), epochs=2, gradient_clip_val=0.05)


@checks.register
def check_validation_predict_and_checkpoint() -> dict[str, Any]:
    """Validation every epoch and a predict after the fit run on the gathered units; a checkpoint holds the whole
    model; a fit resumed from it (sharded again) equals an unsharded one resumed from the same file."""
    x, y = regression_data(64, seed=7)
    validation = DataLoader(TensorDataset(x.float(), y.float()), batch_size=8)
    results = {}
    for shard in ("none", "parameters"):
        module = UnitNet("adamw", scheduler=True)
        options = {"auto_wrap_policy": {Block}} if shard == "parameters" else {}
        trainer = strategy_trainer(
            strategy=HorovodStrategy(shard=shard, bucket_mb=0.0005, **options), max_epochs=2, precision="32-true"
        )
        trainer.fit(module, val_dataloaders=validation)
        path = out_dir() / f"full_shard_{shard}.ckpt"
        trainer.save_checkpoint(path)
        predicted = torch.cat(trainer.predict(module, DataLoader(TensorDataset(x.float()), batch_size=8)))
        results[shard] = {"validated": module.validated, "predicted": predicted, "path": path, "model": module}
    saved = torch.load(results["parameters"]["path"], weights_only=False)["state_dict"]
    whole = results["parameters"]["model"].state_dict()
    resumed = {}
    for shard in ("none", "parameters"):
        module = UnitNet("adamw", scheduler=True)
        options = {"auto_wrap_policy": {Block}} if shard == "parameters" else {}
        trainer = strategy_trainer(
            strategy=HorovodStrategy(shard=shard, bucket_mb=0.0005, **options), max_epochs=4, precision="32-true"
        )
        trainer.fit(module, ckpt_path=str(results["parameters"]["path"]))
        resumed[shard] = parameters_of(module)
    return {
        "validated": max(  # relative to the loss, as the parameters' differences are to the largest parameter
            abs(a - b) / abs(a)
            for a, b in zip(results["none"]["validated"], results["parameters"]["validated"], strict=True)
        ),
        "predicted": float((results["none"]["predicted"] - results["parameters"]["predicted"]).abs().max()),
        "checkpoint_whole": sorted(saved) == sorted(whole)
        and all(torch.equal(saved[name], whole[name]) for name in whole),
        "resumed": float((resumed["parameters"] - resumed["none"]).abs().max() / resumed["none"].abs().max()),
        "path": str(results["parameters"]["path"]),
    }


class TiedByUse(pl.LightningModule):
    """A GPT that ties its head by use, ``norm(h) @ embed.weight.t()``: an embedding, a position parameter, a
    two-layer ``nn.TransformerEncoder`` and a ``LayerNorm`` (no policy: the encoder's layers are the units)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.position = nn.Parameter(torch.randn(1, 8, WIDTH) * 0.02)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(tokens) + self.position[:, : tokens.shape[1]])
        return self.norm(h) @ self.embed.weight.t()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), tokens[:, 1:].reshape(-1))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(6)
        return DataLoader(TensorDataset(torch.randint(0, VOCABULARY, (SAMPLES // 4, 6), generator=generator)), 8)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class HeldAtEachBatch(pl.Callback):
    """The parameter elements this worker holds whole at the end of every validation and predict batch."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.held.append(sum(p.numel() for p in pl_module.parameters()))

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.held.append(sum(p.numel() for p in pl_module.parameters()))


@checks.register
def check_without_fit_and_with_the_default_units() -> dict[str, Any]:
    """``trainer.validate`` and ``trainer.predict`` with no fit before, sharded, with no policy (the three Blocks are
    the units), each loading a checkpoint (``ckpt_path=``) into the model it set up with no optimizer: the same
    losses and predictions as unsharded, and nothing whole after each batch. Then a GPT that
    ties its head by use trains with the default units as unsharded."""
    x, y = regression_data(64, seed=7)
    found: dict[str, Any] = {}
    _, trained, _ = fit("none", UnitNet("sgd"), epochs=1)
    path = str(out_dir() / "without_fit.ckpt")
    trained.save_checkpoint(path)  # the weights validate and predict load (ckpt_path=) into a model of no optimizer
    for shard in ("none", "parameters"):
        module, held = UnitNet("sgd", seed=9), HeldAtEachBatch()
        trainer = strategy_trainer(
            strategy=HorovodStrategy(shard=shard), max_epochs=1, precision="32-true", callbacks=[held]
        )
        trainer.validate(module, DataLoader(TensorDataset(x.float(), y.float()), batch_size=8), ckpt_path=path)
        loader = DataLoader(TensorDataset(x.float()), batch_size=8)
        predicted = torch.cat(trainer.predict(module, loader, ckpt_path=path))
        found[shard] = {"validated": module.validated, "predicted": predicted, "held": held.held}
        tied, _, _ = fit(shard, TiedByUse(), epochs=1, default_units=True)
        found[shard]["tied"] = parameters_of(tied)
    plain, sharded = found["none"], found["parameters"]
    return {
        "validated": max(abs(a - b) / abs(a) for a, b in zip(plain["validated"], sharded["validated"], strict=True)),
        "predicted": float((plain["predicted"] - sharded["predicted"]).abs().max()),
        "held": max(sharded["held"]),
        "whole": max(plain["held"]),
        "tied": float((sharded["tied"] - plain["tied"]).abs().max() / plain["tied"].abs().max()),
    }


@checks.register
def check_recompute_with_every_shard() -> dict[str, float]:
    """``activation_checkpointing_policy={Block}`` with each ``shard``, 10 steps: equal to plain unsharded."""
    reference, _, _ = fit("none", UnitNet("adamw"), epochs=1)
    expected = parameters_of(reference)
    found = {}
    for shard in ("none", "optimizer", "gradients"):
        module, _, _ = fit(shard, UnitNet("adamw"), epochs=1, activation_checkpointing_policy={Block})
        found[shard] = float((parameters_of(module) - expected).abs().max() / expected.abs().max())
    return found


@checks.register
def check_compiled_units() -> dict[str, Any]:
    """Each Block compiled (``block.compile()``), or the stack of Blocks as one (its units' gathers break it into
    graphs), fully sharded for 10 steps: equal to eager unsharded training, and no graph break inside a block.
    ``aot_eager`` traces and differentiates as inductor does, without building kernels."""
    import torch._dynamo.utils

    reference, _, _ = fit("none", UnitNet("adamw"), epochs=1)
    expected = parameters_of(reference)
    found: dict[str, Any] = {}
    for how in ("blocks", "stack"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        module = UnitNet("adamw")
        for compiled in module.blocks if how == "blocks" else [module.blocks]:
            compiled.compile(backend="aot_eager")
        fit("parameters", module, epochs=1)
        found[how] = {
            "difference": float((parameters_of(module) - expected).abs().max() / expected.abs().max()),
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        }
    return found


def fit_built_late(make: Any, shard: str, on_meta: bool, **strategy: Any) -> tuple[Any, Any, list[int], bool]:
    """A fit of a model the Trainer builds (``init_module(empty_init=on_meta)``, or ``configure_model`` when
    ``make`` gives a ConfiguredNet), from seed 11 as the build finds it; whether it was on the meta device."""
    held = HeldParameters()
    options = {"auto_wrap_policy": {Block}} if shard == "parameters" else {}
    trainer = strategy_trainer(
        strategy=HorovodStrategy(shard=shard, bucket_mb=0.0005, **options, **strategy),
        max_epochs=2,
        callbacks=[held],
        precision="32-true",
    )
    torch.manual_seed(11)
    with trainer.init_module(empty_init=None if on_meta else False):
        module = make()
    on_meta = any(p.is_meta for p in module.parameters()) or getattr(module, "built_on_meta", False)
    trainer.fit(module)
    return module, trainer, held.held, on_meta or getattr(module, "built_on_meta", False)


@checks.register
def check_built_on_the_meta_device() -> dict[str, Any]:
    """``init_module(empty_init=True)`` and ``configure_model`` build on the meta device; each worker makes its
    slices real unit by unit, and training equals the same model built whole from the same seed. The first also
    saves its checkpoint in parts (``shard_checkpoint="parts"``)."""
    found: dict[str, Any] = {}
    builds = {"init_module": lambda: UnitNet(seed=None), "configure_model": lambda: ConfiguredNet(seed=None)}
    for name, make in builds.items():
        reference, _, whole, _ = fit_built_late(make, "none", on_meta=False)
        extra = {"shard_checkpoint": "parts"} if name == "init_module" else {}
        sharded, trainer, held, on_meta = fit_built_late(make, "parameters", on_meta=True, **extra)
        expected = parameters_of(reference)
        found[name] = {
            "difference": float((parameters_of(sharded) - expected).abs().max() / expected.abs().max()),
            "held": max(held),
            "whole": max(whole),
            "on_meta": on_meta,
        }
        if extra:
            path = out_dir() / "full_shard_parts.ckpt"
            trainer.save_checkpoint(path)
            found["parts_path"] = str(path)
    return found


@checks.register
def check_resumed_at_another_world_size() -> dict[str, float]:
    """The whole and the parts checkpoints of the four-worker job, resumed fully sharded by this job of another
    size: equal to an unsharded fit resumed from the same file."""
    found = {}
    for name, path in zip(("full", "parts"), os.environ["FULL_SHARD_CHECKPOINTS"].split(","), strict=True):
        resumed = {}
        for shard in ("none", "parameters"):
            options = {"auto_wrap_policy": {Block}} if shard == "parameters" else {}
            trainer = strategy_trainer(
                strategy=HorovodStrategy(shard=shard, bucket_mb=0.0005, **options), max_epochs=3, precision="32-true"
            )
            module = UnitNet("adamw", scheduler=True) if name == "full" else UnitNet(seed=None)
            trainer.fit(module, ckpt_path=path)
            resumed[shard] = parameters_of(module)
        found[name] = float((resumed["parameters"] - resumed["none"]).abs().max() / resumed["none"].abs().max())
    return found


@checks.register
def check_refusals() -> dict[str, str]:
    """What full sharding cannot do says so before training, naming the value."""
    return {
        "daso": refusal(lambda: HorovodStrategy(shard="parameters", sync="daso")),
        "state_dict_types_disagree": refusal(
            lambda: HorovodStrategy(shard="parameters", shard_checkpoint="parts", state_dict_type="full")
        ),
        "policy_without_full_sharding": refusal(lambda: HorovodStrategy(shard="gradients", auto_wrap_policy={Block})),
        "no_unit": refusal(lambda: fit_one_epoch(UnitNet(), auto_wrap_policy={nn.Conv2d})),
        "half_norms_on_cpu": refusal(
            lambda: fit_one_epoch(NormNet(), auto_wrap_policy={nn.LayerNorm}, param_dtype="bf16"),
        ),
    }


class NormNet(UnitNet):
    """UnitNet with a LayerNorm between its Blocks."""

    def build(self) -> None:
        super().build()
        self.blocks = nn.Sequential(Block(), nn.LayerNorm(WIDTH), Block())


def fit_one_epoch(module: pl.LightningModule, **strategy_options: Any) -> None:
    strategy_trainer(strategy=HorovodStrategy(shard="parameters", **strategy_options), max_epochs=1).fit(module)


def refusal(attempt: Any) -> str:
    """The ValueError ``attempt()`` raises, as text; ``"accepted"`` when it raises none."""
    try:
        attempt()
    except ValueError as error:
        return str(error)
    return "accepted"


if __name__ == "__main__":
    out, args = parse_out()
    hvd.init()
    torch.set_num_threads(1)
    report = checks.selected(args.case).run()
    write_result(out, hvd.rank(), report)
    sys.exit(0)
