"""Checkpoints written here in torch's format (DCP, ``state_dict_type="sharded"``), read back by any world size
and by FSDP2.

``--save`` (``horovodrun``, 4 workers on two emulated nodes): for each shard mode ``AttentionGPT`` trains AdamW
steps under Fabric and ``fabric.save`` writes a DCP directory after the first two (the second replaces the first;
ZeRO-3 saves with ``async_save`` and trains a third step while the files are written); rank 0 keeps the saved
state whole beside it to compare with (``reference_<mode>.pt``). A ZeRO-3 Trainer fit with ``async_save`` writes a
DCP directory at every step through ``ModelCheckpoint``, and keeps its final weights (``trainer_after.pt``).

``--load`` (``horovodrun``, 2 workers): each directory loads into a ZeRO-3 Fabric model and AdamW (the unsharded
one's also into ``shard="none"``); the Trainer resumes from its step-2 directory and trains to step 3.

``--killed`` (``horovodrun``, 4 workers): a ZeRO-3 ``async_save`` whose rank 3 dies mid-write; ``--resume-killed``
(2 workers) loads the folder: the last complete checkpoint.

``--fsdp2`` (``torch.distributed.run``, 2 processes): FSDP2's ``dcp.load`` reads the ZeRO-3 directory into a
``fully_shard`` model's ``get_model_state_dict`` and ``get_optimizer_state_dict``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from _common import parse_out, write_result
from dcp_interop import GPTModule, lightning_data, lightning_trainer
from sharded_fabric_checks import AttentionGPT, token_loss

from hvd_plugins import HorovodStrategy as TrainerStrategy

SAVED_MODES = ("none", "optimizer", "parameters")
LOADS_INTO = {"none": ("parameters",), "optimizer": ("parameters",), "parameters": ("parameters", "none")}


def batch(step: int) -> torch.Tensor:
    """The same batch on every worker: the state does not depend on the number of workers."""
    return torch.randint(0, 48, (2, 13), generator=torch.Generator().manual_seed(30 + step))


def by_name(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {names[index]: values for index, values in optimizer_state["state"].items()}


def from_reference(
    weights: dict[str, torch.Tensor], moments: dict[str, dict[str, Any]], reference: dict[str, Any]
) -> dict[str, Any]:
    """How far loaded weights and AdamW moments (by parameter name) are from the saved ``reference``, and the step
    counts loaded."""
    return {
        "weights": max(float((weights[k] - v).abs().max()) for k, v in reference["model"].items()),
        "moments": max(
            float((moments[name][key] - values[key]).abs().max())
            for name, values in reference["optim"].items()
            for key in ("exp_avg", "exp_avg_sq")
        ),
        "steps": sorted({float(values["step"]) for values in moments.values()}),
    }


def save(out: Path) -> None:
    import horovod.torch as hvd
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    report: dict[str, Any] = {}
    for shard in SAVED_MODES:
        background = shard == "parameters"  # async_save: the files written while the next step trains
        strategy = HorovodStrategy(shard=shard, state_dict_type="sharded", async_save=background)
        fabric = Fabric(strategy=strategy, accelerator="cpu")
        fabric.launch()
        torch.manual_seed(3)
        module = AttentionGPT()
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
        folder = out / f"fabric_{shard}"
        for step in range(3):
            tokens = batch(step)
            fabric.backward(token_loss(model(tokens[:, :-1]), tokens[:, 1:]))
            optimizer.step()
            optimizer.zero_grad()
            if step == 2:
                break  # trained after the last save: none of it may reach the checkpoint
            fabric.save(folder, {"model": model, "optim": optimizer, "step": step + 1})
            if step == 1:  # the state saved, gathered whole (collectives beside the thread that writes)
                weights = {key: value.clone() for key, value in model.state_dict().items()}
                names = [name for name, _ in model.module.named_parameters()]
                moments = copy.deepcopy(by_name(optimizer.state_dict(), names))  # unsharded: the live tensors
        strategy.wait_for_checkpoint()
        if fabric.global_rank == 0:
            torch.save({"model": weights, "optim": moments}, out / f"reference_{shard}.pt")
        report[shard] = (folder / f"__{hvd.rank()}_0.distcp").stat().st_size
    report["trainer"] = trainer_saves(out)
    write_result(out, hvd.rank(), report)


def trainer_saves(out: Path) -> list[str]:
    """A ZeRO-3 fit of 3 steps; ``ModelCheckpoint`` writes a DCP directory at each."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(3)
    module = GPTModule()
    every_step = ModelCheckpoint(dirpath=out / "trainer", every_n_train_steps=1, save_top_k=-1)
    strategy = TrainerStrategy(shard="parameters", state_dict_type="sharded", async_save=True)
    trainer = lightning_trainer(3, strategy=strategy, callbacks=[every_step], enable_checkpointing=True)
    trainer.fit(module, lightning_data())
    weights = module.state_dict()
    if trainer.global_rank == 0:
        torch.save(weights, out / "trainer_after.pt")
    return sorted(path.name for path in (out / "trainer").iterdir())


def load(out: Path) -> None:
    import horovod.torch as hvd
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    report: dict[str, Any] = {}
    for saved in SAVED_MODES:
        reference = torch.load(out / f"reference_{saved}.pt", weights_only=False)
        for shard in LOADS_INTO[saved]:
            fabric = Fabric(strategy=HorovodStrategy(shard=shard), accelerator="cpu")
            fabric.launch()
            torch.manual_seed(100 + hvd.rank())  # other values than the checkpoint's on every worker
            module = AttentionGPT()
            model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
            left = fabric.load(out / f"fabric_{saved}", {"model": model, "optim": optimizer})
            weights = model.state_dict()
            moments = by_name(optimizer.state_dict(), [name for name, _ in model.module.named_parameters()])
            report[f"{saved}->{shard}"] = {**from_reference(weights, moments, reference), "left": left}
    report["trainer"] = trainer_resumes(out)
    report["other_model"] = other_model_refused(out)
    write_result(out, hvd.rank(), report)


def other_model_refused(out: Path) -> str:
    """A checkpoint of another model (wider) loaded under ZeRO-3: the error every worker raises alike."""
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    fabric = Fabric(strategy=HorovodStrategy(shard="parameters"), accelerator="cpu")
    fabric.launch()
    module = AttentionGPT(width=40)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    try:
        fabric.load(out / "fabric_parameters", {"model": model, "optim": optimizer})
    except RuntimeError as error:
        return str(error)
    return ""


def trainer_resumes(out: Path) -> dict[str, Any]:
    """The Trainer's step-2 directory, resumed under ZeRO-3 at 2 workers to step 3: the 4-worker fit's weights."""
    module = GPTModule()
    trainer = lightning_trainer(3, strategy=TrainerStrategy(shard="parameters"))
    trainer.fit(module, lightning_data(), ckpt_path=out / "trainer" / "epoch=0-step=2.ckpt")
    weights, expected = module.state_dict(), torch.load(out / "trainer_after.pt")
    return {
        "global_step": trainer.global_step,
        "from_four_workers": max(float((weights[k] - v).abs().max()) for k, v in expected.items()),
    }


def killed_mid_write(out: Path) -> None:
    """ZeRO-3 with ``async_save``: the step-1 checkpoint completes; while step 2's is written in the background,
    rank 3 dies once its own files are on disk (the others wait for it to report): the job ends."""
    import horovod.torch as hvd
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    strategy = HorovodStrategy(shard="parameters", state_dict_type="sharded", async_save=True)
    fabric = Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    torch.manual_seed(3)
    module = AttentionGPT()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    folder = out / "killed"
    for step in range(2):
        tokens = batch(step)
        fabric.backward(token_loss(model(tokens[:, :-1]), tokens[:, 1:]))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            fabric.save(folder, {"model": model, "optim": optimizer, "step": 1})
            strategy.wait_for_checkpoint()
            weights = {key: value.clone() for key, value in model.state_dict().items()}
            if hvd.rank() == 0:
                torch.save(weights, out / "killed_reference.pt")
            if hvd.rank() == 3:
                die_after_writing()
    fabric.save(folder, {"model": model, "optim": optimizer, "step": 2})
    strategy.wait_for_checkpoint()  # never returns: rank 3 is gone
    write_result(out, hvd.rank(), {"finished": True})


def die_after_writing() -> None:
    """The next checkpoint this process writes kills it once its own files are written."""
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        written = write_data(self, plan, planner)
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL)
        return written

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


def resume_after_kill(out: Path) -> None:
    """2 workers resume from the killed job's folder: the step-1 checkpoint, whole."""
    import horovod.torch as hvd
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    fabric = Fabric(strategy=HorovodStrategy(shard="parameters"), accelerator="cpu")
    fabric.launch()
    module = AttentionGPT()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    left = fabric.load(out / "killed", {"model": model, "optim": optimizer})
    weights, expected = model.state_dict(), torch.load(out / "killed_reference.pt")
    write_result(
        out,
        hvd.rank(),
        {"left": left, "weights": max(float((weights[k] - v).abs().max()) for k, v in expected.items())},
    )


def fsdp2_loads(out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(100 + dist.get_rank())
    model = AttentionGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = batch(0)
    token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()  # AdamW's state exists, as when resuming a run
    optimizer.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(out / "fabric_parameters"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    whole = StateDictOptions(full_state_dict=True)  # on every rank (cpu_offload keeps it on rank 0 alone)
    weights = get_model_state_dict(model, options=whole)
    moments = get_optimizer_state_dict(model, optimizer, options=whole)["state"]
    reference = torch.load(out / "reference_parameters.pt", weights_only=False)
    found = from_reference(weights, moments, reference)
    (out / f"fsdp2_rank{dist.get_rank()}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    out, _ = parse_out()
    if "--save" in sys.argv:
        save(out)
    elif "--killed" in sys.argv:
        killed_mid_write(out)
    elif "--resume-killed" in sys.argv:
        resume_after_kill(out)
    elif "--fsdp2" in sys.argv:
        fsdp2_loads(out)
    else:
        load(out)
