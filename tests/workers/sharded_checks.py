"""Sharded training (``shard="optimizer"`` and ``shard="gradients"``) against unsharded training, on real workers.

Run under ``horovodrun -np 4 -H localhost:2,127.0.0.1:2`` (two emulated nodes) or ``-np 2``; with
``--resume CKPT`` the 2-worker job resumes a checkpoint the 4-worker job saved. Every run trains the
same model on the same data twice, sharded and not, and reports the largest difference of the
parameters relative to the largest parameter (float32: the order of the sums is the only difference).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks, out_dir, parse_out, write_result
from finetuning import UnfreezeExtra
from models import Gan, regression_data
from strategy_common import trainer as strategy_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch import HorovodStrategy
from hvd_plugins.pytorch.callbacks import PeakMemoryMonitor

checks = Checks()
SHARDS = ("optimizer", "gradients")
SAMPLES = 320  # 10 steps an epoch on 4 workers of 8 samples: 50 steps in 5 epochs


class ShardNet(pl.LightningModule):
    """5 -> 33 -> 1 with tanh and a side layer ``extra``; ``optimizer`` names the optimizer."""

    def __init__(self, optimizer: str = "adam", scheduler: bool = False, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(5, 33), nn.Tanh(), nn.Linear(33, 1))
        self.extra = nn.Linear(5, 1)
        self.lookup = nn.Embedding(4, 1, sparse=sparse) if sparse else None
        self.optimizer_name, self.scheduler = optimizer, scheduler

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        prediction = self.net(x) + 0.1 * self.extra(x)
        if self.lookup is not None:
            prediction = prediction + self.lookup(torch.zeros(len(x), dtype=torch.long))
        loss = nn.functional.mse_loss(prediction, y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        x, y = regression_data(SAMPLES, seed=5)
        return DataLoader(TensorDataset(x.float(), y.float()), batch_size=8)

    def configure_optimizers(self) -> Any:
        parameters = self.parameters()
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
        elif self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(parameters, lr=0.01, weight_decay=0.1)
        elif self.optimizer_name == "lbfgs":
            optimizer = torch.optim.LBFGS(parameters)
        else:
            optimizer = torch.optim.Adam(parameters, lr=0.01)
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}


def parameters_of(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def fit(shard: str, module: pl.LightningModule | None = None, epochs: int = 5, **options: Any) -> tuple[Any, Any]:
    names = ("compression", "op", "scale_lr", "bucket_mb", "shard_checkpoint", "sync")
    strategy_options = {k: options.pop(k) for k in names if k in options}
    model = module if module is not None else ShardNet()
    ckpt_path = options.pop("ckpt_path", None)
    if callable(options.get("callbacks")):
        options["callbacks"] = options["callbacks"]()  # a fresh callback for every run
    bucket_mb = strategy_options.pop("bucket_mb", 0.0005)
    trainer = strategy_trainer(
        strategy=HorovodStrategy(shard=shard, bucket_mb=bucket_mb, **strategy_options),
        max_epochs=epochs,
        **{"precision": "32-true", **options},
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def differences(make: Any, **options: Any) -> dict[str, float]:
    """Per stage, the largest |sharded - unsharded| over the parameters, relative to the largest unsharded one."""
    reference, _ = fit("none", make(), **dict(options))
    expected = parameters_of(reference)
    found = {}
    for shard in SHARDS:
        sharded, _ = fit(shard, make(), **dict(options))
        found[shard] = float((parameters_of(sharded) - expected).abs().max() / expected.abs().max())
    return found


CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd_momentum": (lambda: ShardNet("sgd"), {}),
    "adam": (lambda: ShardNet("adam"), {}),
    "adamw_scheduler": (lambda: ShardNet("adamw", scheduler=True), {}),
    "clip_norm": (lambda: ShardNet("adam"), {"gradient_clip_val": 0.05}),
    "clip_value": (lambda: ShardNet("sgd"), {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "accumulation": (lambda: ShardNet("adam"), {"accumulate_grad_batches": 2}),
    "fp16_wire": (lambda: ShardNet("adam"), {"compression": "fp16"}),
    "op_sum": (lambda: ShardNet("sgd"), {"op": "sum"}),
    "scale_lr": (lambda: ShardNet("sgd"), {"scale_lr": True}),
    "bf16_mixed": (lambda: ShardNet("adam"), {"precision": "bf16-mixed"}),
    "one_bucket": (lambda: ShardNet("adamw"), {"bucket_mb": 32.0}),
}


@checks.register
def check_equal_to_unsharded() -> dict[str, dict[str, float]]:
    """Every case, both stages, 50 steps: the parameters equal the unsharded run's up to the order of sums."""
    return {case: differences(make, **options) for case, (make, options) in CASES.items()}


@checks.register
def check_a_short_run_equals_unsharded() -> dict[str, float]:
    """AdamW with a scheduler, clipped by norm, 20 steps: the one equality the job for ``pytorch_lightning`` runs."""
    return differences(lambda: ShardNet("adamw", scheduler=True), epochs=2, gradient_clip_val=0.05)


@checks.register
def check_two_optimizers_and_unfreezing() -> dict[str, dict[str, float]]:
    """A GAN's two optimizers (manual optimization), and a layer unfrozen mid-training into a new param group."""
    return {
        "gan": differences(lambda: GanOnFloats(), epochs=2),
        "unfreeze": differences(lambda: ShardNet("adam"), callbacks=lambda: [UnfreezeExtra(new_group=True, epoch=2)]),
    }


class GanOnFloats(Gan):
    """The strategy checks' GAN (two Adam optimizers, manual optimization), on float32 data."""

    def __init__(self) -> None:
        super().__init__(toggle=True)

    def train_dataloader(self) -> DataLoader:
        x, _ = regression_data(64, seed=6)
        return DataLoader(TensorDataset(x.float()), batch_size=8)


@checks.register
def check_partition() -> dict[str, Any]:
    """Per worker, the optimizer state is 1/N of the unsharded state (plus padding); ZeRO-2 frees whole gradients."""
    found: dict[str, Any] = {}
    for shard in ("none", *SHARDS):
        monitor = PeakMemoryMonitor(print_table=False)
        model, trainer = fit(shard, ShardNet("adam"), epochs=1, callbacks=[monitor])
        optimizer = trainer.optimizers[0]
        inner = getattr(optimizer, "inner", optimizer)
        state = sum(
            v.numel() * v.element_size()
            for s in inner.state.values()
            for k, v in s.items()
            if isinstance(v, torch.Tensor) and k != "step"
        )
        found[shard] = {
            "state_bytes": state,
            "parameters": sum(p.numel() for p in model.parameters()),
            "whole_gradients_left": sum(p.grad is not None for p in model.parameters()),
            "slices": len(getattr(optimizer, "slices", [])),
            "monitor": {k: v[hvd.rank()] for k, v in monitor.history[-1].per_worker.items() if not k.startswith("cpu")},
            "identical_across_workers": bool(
                (hvd.allgather(parameters_of(model).unsqueeze(0)) == parameters_of(model)).all()
            ),
        }
    found["workers"] = hvd.size()
    return found


@checks.register
def check_inside_the_node() -> dict[str, Any]:
    """``sync="hierarchical"`` with sharding on two nodes of two workers: the parameters of flat sharding (and of
    the unsharded two-level allreduce), half the state per worker, no more cross-node bytes than unsharded."""
    found: dict[str, Any] = {}
    unsharded, two_level = fit("none", ShardNet("adam"), sync="hierarchical")
    expected = parameters_of(unsharded)
    found["two_level_cross_bytes"] = two_level.strategy.comm_counters.cross_node_bytes
    for shard in SHARDS:
        flat, _ = fit(shard, ShardNet("adam"))
        inside, trainer = fit(shard, ShardNet("adam"), sync="hierarchical")
        optimizer = trainer.optimizers[0]
        scale = expected.abs().max()
        found[shard] = {
            "from_flat_sharding": float((parameters_of(inside) - parameters_of(flat)).abs().max() / scale),
            "from_unsharded": float((parameters_of(inside) - expected).abs().max() / scale),
            "shard_world": optimizer.world.size,
            "state_bytes": optimizer.state_bytes(),
            "whole_state_bytes": sum(
                v.numel() * v.element_size()
                for s in optimizer.state_dict()["state"].values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ),
            "cross_bytes": trainer.strategy.comm_counters.cross_node_bytes,
            "identical_across_workers": bool(
                (hvd.allgather(parameters_of(inside).unsqueeze(0)) == parameters_of(inside)).all()
            ),
        }
    found["parts"] = resume_inside_the_node()
    return found


def resume_inside_the_node() -> dict[str, Any]:
    """A checkpoint in parts written by the first node's workers resumes as the same checkpoint saved whole."""
    resumed = {}
    for how in ("parts", "full"):
        options = {"sync": "hierarchical", "shard_checkpoint": how}
        _, trainer = fit("gradients", ShardNet("adamw", scheduler=True), epochs=2, **options)
        path = out_dir() / f"inside_node_{how}.ckpt"
        trainer.save_checkpoint(path)
        hvd.allreduce(torch.zeros(1), name=f"inside_node_{how}_written")  # every file is on disk before any read
        model, _ = fit("gradients", ShardNet("adamw", scheduler=True), epochs=4, ckpt_path=str(path), **options)
        resumed[how] = parameters_of(model)
    return {
        "files": sorted(p.name for p in out_dir().glob("inside_node_parts.ckpt.optimizer-part-*")),
        "parts_vs_full": float((resumed["parts"] - resumed["full"]).abs().max()),
    }


@checks.register
def check_save_for_resume() -> dict[str, Any]:
    """ZeRO-2 saves a checkpoint after 2 epochs (the consolidated state), and unsharded does the same."""
    saved = {}
    for shard in ("gradients", "none"):
        model, trainer = fit(shard, ShardNet("adamw", scheduler=True), epochs=2)
        path = out_dir() / f"shard_{shard}.ckpt"
        trainer.save_checkpoint(path)
        saved[shard] = str(path)
    if hvd.rank() == 0:
        sharded = torch.load(saved["gradients"], weights_only=False)["optimizer_states"][0]
        plain = torch.load(saved["none"], weights_only=False)["optimizer_states"][0]
        state_difference = max(
            float((sharded["state"][i][k] - plain["state"][i][k]).abs().max())
            for i in plain["state"]
            for k in plain["state"][i]
            if isinstance(plain["state"][i][k], torch.Tensor) and plain["state"][i][k].dim() > 0
        )
        same_keys = (
            sorted(sharded["state"]) == sorted(plain["state"]) and sharded["param_groups"] == plain["param_groups"]
        )
    else:
        state_difference, same_keys = 0.0, True
    return {"paths": saved, "state_difference": state_difference, "same_layout": same_keys}


@checks.register
def check_refusals() -> dict[str, str]:
    """What sharding cannot do says so before training, naming the value."""
    found = {}
    for name, make in {
        "adasum": lambda: HorovodStrategy(shard="gradients", op="adasum"),
        "daso": lambda: HorovodStrategy(shard="optimizer", sync="daso"),
        "hierarchical_native": lambda: HorovodStrategy(
            shard="optimizer", sync="hierarchical", hierarchical_impl="native"
        ),
        "unknown": lambda: HorovodStrategy(shard="everything"),  # type: ignore[arg-type]
    }.items():
        try:
            make()
            found[name] = "accepted"
        except ValueError as error:
            found[name] = str(error)
    for name, module in {"lbfgs": ShardNet("lbfgs"), "sparse": ShardNet("sgd", sparse=True)}.items():
        try:
            fit("gradients", module, epochs=1)
            found[name] = "accepted"
        except ValueError as error:
            found[name] = str(error)
    return found


@checks.register
def check_sixteen_mixed() -> dict[str, float]:
    """``precision="16-mixed"``: float16 autocast (on CPU Lightning brings no GradScaler), both stages as unsharded."""
    return differences(lambda: ShardNet("adam"), precision="16-mixed")


@checks.register
def check_parts_checkpoint() -> dict[str, Any]:
    """``shard_checkpoint="parts"``: every worker writes its part; the same 4 workers resume from their own parts
    exactly as from the whole state (check_save_for_resume's checkpoint)."""
    _, trainer = fit("gradients", ShardNet("adamw", scheduler=True), epochs=2, shard_checkpoint="parts")
    path = out_dir() / "shard_parts.ckpt"
    trainer.save_checkpoint(path)
    hvd.allreduce(torch.zeros(1), name="parts_written")  # every part is on disk before anyone reads
    resumed = {}
    for name, checkpoint, how in (("parts", path, "parts"), ("full", out_dir() / "shard_gradients.ckpt", "full")):
        module = ShardNet("adamw", scheduler=True)
        model, _ = fit("gradients", module, epochs=4, shard_checkpoint=how, ckpt_path=str(checkpoint))
        resumed[name] = parameters_of(model)
    main = torch.load(path, weights_only=False)
    return {
        "path": str(path),
        "marker": main["optimizer_states"],
        "parts_vs_full": float((resumed["parts"] - resumed["full"]).abs().max()),
    }


def resume(checkpoint: str, parts: str) -> dict[str, float]:
    """2 workers resume the 4-worker job's checkpoints for 2 more epochs, sharded and not, and sharded from the
    checkpoint saved in parts (consolidated on load): equal."""
    results = {}
    for shard, path in (("gradients", checkpoint), ("none", checkpoint), ("parts", parts)):
        model = ShardNet("adamw", scheduler=True)
        strategy = HorovodStrategy(shard="gradients" if shard == "parts" else shard, bucket_mb=0.0005)
        trainer = strategy_trainer(strategy=strategy, precision="32-true", max_epochs=4)
        trainer.fit(model, ckpt_path=path)
        results[shard] = parameters_of(model)
    expected = results["none"]
    return {
        "vs_unsharded": float((results["gradients"] - expected).abs().max() / expected.abs().max()),
        "parts_vs_full": float((results["parts"] - results["gradients"]).abs().max()),
    }


def resume_single(checkpoint: str) -> dict[str, Any]:
    """One plain process, Lightning's own strategy, no Horovod: the sharded job's checkpoint loads and trains on."""
    model = ShardNet("adamw", scheduler=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=4, logger=False, enable_checkpointing=False)
    trainer.fit(model, ckpt_path=checkpoint)
    return {
        "epochs": trainer.current_epoch,
        "horovod": hvd.is_initialized(),
        "optimizer": type(trainer.optimizers[0]).__name__,
    }


if __name__ == "__main__":
    out, _ = parse_out()
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default="")
    parser.add_argument("--resume-parts", default="")
    parser.add_argument("--resume-single", default="")
    args, _ = parser.parse_known_args()
    if args.resume_single:
        write_result(out, 0, {"resume_single": {"ok": True, "value": resume_single(args.resume_single)}})
        sys.exit(0)
    hvd.init()
    torch.set_num_threads(1)
    if args.resume:
        report: dict[str, Any] = {"resume": {"ok": True, "value": resume(args.resume, args.resume_parts)}}
    else:
        report = checks.selected(parse_out()[1].case).run()
    write_result(out, hvd.rank(), report)
    sys.exit(0)
