"""A checkpoint torch's FSDP2 wrote with ``dcp.save``, loaded by ``fabric.load`` under HorovodStrategy.

``--write`` (under ``torch.distributed.run``, Gloo): ``AttentionGPT`` with ``fully_shard`` per block and on the
root trains 2 AdamW steps, then saves ``{"model": get_model_state_dict, "optim": get_optimizer_state_dict}`` with
``dcp.save`` into ``<out>/fsdp2``, as FSDP2's docs and torchtitan do; rank 0 also writes the whole state
(``reference.pt``) to compare with.

``--write-lightning`` (one process): a Trainer's checkpoint laid out as Lightning's sharded FSDP writes it.

``--load`` (under ``horovodrun``, another number of workers): for each shard mode a fresh model and AdamW set up
by Fabric load the directory with ``fabric.load``; each worker reports how far its parameters and consolidated
AdamW moments are from the reference, and the message a directory that is no checkpoint gives.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import parse_out, write_result
from sharded_fabric_checks import AttentionGPT, token_loss
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins import HorovodStrategy as TrainerStrategy

SHARD_MODES = ("none", "optimizer", "parameters")


class GPTModule(pl.LightningModule):
    """``AttentionGPT``'s parameters under the same names, as a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        gpt = AttentionGPT()
        self.embed, self.blocks, self.head = gpt.embed, gpt.blocks, gpt.head
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return AttentionGPT.forward(self, tokens)  # type: ignore[arg-type]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return token_loss(self(batch[0][:, :-1]), batch[0][:, 1:])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", token_loss(self(batch[0][:, :-1]), batch[0][:, 1:]), sync_dist=True)
        self.seen = {key: value.clone() for key, value in self.state_dict().items()}  # in inference mode

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def lightning_data() -> DataLoader:
    """Two batches of two sequences: a Lightning epoch of two steps, the same on every worker (no sampler)."""
    tokens = torch.randint(0, 48, (4, 13), generator=torch.Generator().manual_seed(9))
    return DataLoader(TensorDataset(tokens), batch_size=2)


def lightning_trainer(max_steps: int, **options: Any) -> pl.Trainer:
    defaults = {"enable_checkpointing": False, "enable_model_summary": "callbacks" in options}
    return pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        **{**defaults, **options},
    )


def write_lightning(out: Path) -> None:
    """One process trains ``GPTModule`` one epoch (2 steps) and saves it; the checkpoint is laid out again as
    Lightning's ``FSDPStrategy(state_dict_type="sharded")`` writes it (FSDP needs a GPU in Lightning): DCP of
    ``{"model": state_dict, "optimizer_0": optimizer state by parameter name}``, the rest in ``meta.pt``. The same
    process then resumes from its own file for one more step: the weights to compare with."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(3)
    module = GPTModule()
    trainer = lightning_trainer(2, devices=1)
    trainer.fit(module, lightning_data())
    file = out / "lightning.ckpt"
    trainer.save_checkpoint(file)
    checkpoint = torch.load(file, weights_only=False)
    names = [name for name, _ in module.named_parameters()]
    saved = checkpoint.pop("optimizer_states")[0]
    by_name = {
        "state": {names[index]: state for index, state in saved["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in saved["param_groups"]],
    }
    folder = out / "lightning_sharded"
    dcp.save({"model": checkpoint.pop("state_dict"), "optimizer_0": by_name}, checkpoint_id=str(folder), no_dist=True)
    torch.save(checkpoint, folder / "meta.pt")
    resumed = GPTModule()
    lightning_trainer(3, devices=1).fit(resumed, lightning_data(), ckpt_path=file)
    torch.save(resumed.state_dict(), out / "lightning_after.pt")


def write(out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(3)
    model = AttentionGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(20 + rank)
    for _ in range(2):
        tokens = torch.randint(0, 48, (2, 13), generator=generator)
        token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(out / "fsdp2"))
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    reference = {
        "model": get_model_state_dict(model, options=whole),
        "optim": get_optimizer_state_dict(model, optimizer, options=whole),
    }
    if rank == 0:
        torch.save(reference, out / "reference.pt")
    write_result(out, rank, {"saved": True})
    dist.destroy_process_group()


def load(out: Path) -> None:
    import horovod.torch as hvd
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    reference = torch.load(out / "reference.pt", weights_only=False)
    report: dict[str, Any] = {}
    after: dict[str, dict[str, torch.Tensor]] = {}  # the weights after one step from the loaded state, per mode
    for shard in SHARD_MODES:
        fabric = Fabric(strategy=HorovodStrategy(shard=shard), accelerator="cpu")
        fabric.launch()
        torch.manual_seed(100 + hvd.rank())  # other values than the checkpoint's on every worker
        module = AttentionGPT()
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
        fabric.load(out / "fsdp2", {"model": model, "optim": optimizer})
        weights = {key: value.clone() for key, value in model.state_dict().items()}
        names = [name for name, _ in model.module.named_parameters()]
        moments = optimizer.state_dict()["state"]  # consolidated, by index: a collective when sharded
        saved = reference["optim"]["state"]
        report[shard] = {
            "weights": max(float((weights[k] - v).abs().max()) for k, v in reference["model"].items()),
            "moments": max(
                float((moments[index][key] - saved[name][key]).abs().max())
                for index, name in enumerate(names)
                for key in ("exp_avg", "exp_avg_sq")
            ),
            "steps": sorted({float(moments[index]["step"]) for index in range(len(names))}),
        }
        # one more step from the loaded state (every worker the same batch): equal in every mode
        tokens = torch.randint(0, 48, (2, 13), generator=torch.Generator().manual_seed(7))
        fabric.backward(token_loss(model(tokens[:, :-1]), tokens[:, 1:]))
        optimizer.step()
        after[shard] = {key: value.clone() for key, value in model.state_dict().items()}
        report[shard]["moved"] = max(float((after[shard][k] - weights[k]).abs().max()) for k in weights)
        report[shard]["from_unsharded"] = max(float((after[shard][k] - after["none"][k]).abs().max()) for k in weights)
    report["trainer"] = trainer_loads(out, reference, after["none"])
    report["lightning"] = trainer_resumes_lightning(out)
    empty = out / f"not_a_checkpoint_{hvd.rank()}"
    empty.mkdir(exist_ok=True)
    try:
        fabric.load(empty, {"model": model})
        report["refused"] = ""
    except ValueError as error:
        report["refused"] = str(error)
    write_result(out, hvd.rank(), report)


def trainer_loads(out: Path, reference: dict[str, Any], stepped: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The same directory through the Trainer's ``ckpt_path=``, ZeRO-3: ``validate`` takes its weights, and
    ``fit`` starts from its weights and AdamW moments (a plain DCP checkpoint holds no loop position) for one step
    on the batch the Fabric loop stepped on, which must give ``stepped``, the unsharded Fabric step."""
    tokens = torch.randint(0, 48, (2, 13), generator=torch.Generator().manual_seed(7))
    data = DataLoader(TensorDataset(tokens), batch_size=2)  # every worker the whole of it: the same batch
    found: dict[str, Any] = {}
    for function in ("validate", "fit"):
        trainer = lightning_trainer(1, strategy=TrainerStrategy(shard="parameters"), limit_val_batches=1)
        module = GPTModule()
        if function == "validate":
            found["val_loss"] = trainer.validate(module, data, ckpt_path=out / "fsdp2", verbose=False)[0]["val_loss"]
            weights = module.state_dict()  # whole again after validate
            found["weights"] = max(float((weights[k] - v).abs().max()) for k, v in reference["model"].items())
            found["seen"] = max(float((module.seen[k] - v).abs().max()) for k, v in reference["model"].items())
        else:
            trainer.fit(module, data, ckpt_path=out / "fsdp2")
            weights = module.state_dict()  # whole again after fit
            found["from_fabric_step"] = max(float((weights[k] - v).abs().max()) for k, v in stepped.items())
            found["global_step"] = trainer.global_step
    return found


class SummaryTotal(pl.Callback):
    """The parameters the Trainer's model summary counts once the fit has set the model up (sharded)."""

    total = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = next(c for c in trainer.callbacks if isinstance(c, pl.callbacks.ModelSummary))  # type: ignore[attr-defined]
        self.total = summary._summary(trainer, pl_module).total_parameters


def trainer_resumes_lightning(out: Path) -> dict[str, Any]:
    """Lightning's sharded layout through ``ckpt_path=`` under ZeRO-3: the fit goes on from the step it stopped at
    (its loops from ``meta.pt``) for one more step, equal to the one process that resumed from its own file. The
    model summary counts the whole model, though each parameter holds a shard."""
    module, counted = GPTModule(), SummaryTotal()
    trainer = lightning_trainer(3, strategy=TrainerStrategy(shard="parameters"), callbacks=[counted])
    trainer.fit(module, lightning_data(), ckpt_path=out / "lightning_sharded")
    weights, expected = module.state_dict(), torch.load(out / "lightning_after.pt")
    return {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "from_one_process": max(float((weights[k] - v).abs().max()) for k, v in expected.items()),
        "summary_total": counted.total,
        "whole": sum(p.numel() for p in GPTModule().parameters()),
    }


if __name__ == "__main__":
    out, _ = parse_out()
    if "--write" in sys.argv:
        write(out)
    elif "--write-lightning" in sys.argv:
        write_lightning(out)
    else:
        load(out)
