"""Reading a checkpoint that torch's distributed checkpointing (DCP) wrote: FSDP2's ``dcp.save``, Lightning's
``FSDPStrategy(state_dict_type="sharded")`` and ``ModelParallelStrategy``, torchtitan.

A DCP checkpoint is a directory: a ``.metadata`` file that says which boxes of which tensor each shard file holds,
and the shard files. Every worker reads it whole, as torch's own ``dcp_to_torch_save`` does, in one process with
no collective (``no_dist``), so it loads at any number of workers and in any shard mode; a sharded mode then keeps
its slices of what it read. Lightning writes the state that is not tensors beside it, in ``meta.pt``.

Optimizer state in such a checkpoint is keyed by parameter name (``get_optimizer_state_dict``'s layout: ``state``
by name, each param group's ``params`` a list of names); ``by_parameter_index`` turns it into the layout a torch
optimizer's ``load_state_dict`` takes, by the names of the model the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

METADATA_FILE = ".metadata"
"""The file that makes a directory a DCP checkpoint."""
LIGHTNING_META_FILE = "meta.pt"
"""Where Lightning's sharded checkpoints keep the state that is not tensors."""
COMPILED_PREFIX = "_orig_mod."


def is_dcp_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory that DCP wrote (it holds ``.metadata``)."""
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


def refuse_other_directory(path: str | Path) -> None:
    """A directory that is not a DCP checkpoint: say what was expected (before any worker waits on another)."""
    found = sorted(entry.name for entry in Path(path).iterdir())[:5]
    raise ValueError(
        f"{str(path)!r} is a directory but not a checkpoint: a checkpoint directory is one torch's distributed "
        f"checkpointing wrote (it holds {METADATA_FILE!r}; found {found or 'nothing'}). Give the directory "
        "dcp.save or a sharded FSDP checkpoint wrote, or a checkpoint file"
    )


def read_dcp(path: str | Path, lazy: Callable[[str], bool] = lambda key: False) -> dict[str, Any]:
    """The checkpoint at ``path`` as one nested dict (tensors whole, on the CPU), Lightning's ``meta.pt`` merged
    in; each top-level key that ``lazy`` accepts is left on disk as a ``DcpSource``, read later where it is loaded
    (a sharded mode then reads only its slices). A directory that is no DCP checkpoint, and a missing or
    unreadable shard file, are named in the error."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from hvd_plugins.core.checkpoint.dcp_source import DcpSource, read_selected

    if not is_dcp_checkpoint(path):
        refuse_other_directory(path)
    reader = FileSystemReader(path)
    files = {getattr(info, "relative_path", "") for info in reader.read_metadata().storage_data.values()}
    if missing := sorted(name for name in files if name and not (Path(path) / name).is_file()):
        raise ValueError(
            f"the checkpoint directory {str(path)!r} lacks {len(missing)} of the {len(files)} shard files its "
            f"{METADATA_FILE!r} names: {missing[:4]}. Copy every file the job that saved it wrote"
        )
    metadata = reader.read_metadata()
    tops = {str((metadata.planner_data or {}).get(key, (key,))[0]) for key in metadata.state_dict_metadata}
    left = {key for key in tops if lazy(key)}
    state: dict[str, Any] = {}
    try:
        read_selected(reader, state, lambda entry: str(entry[0]) not in left)
    except CheckpointException as error:  # a BaseException: a failure on some rank, wrapped
        causes = [str(cause) for cause in getattr(error, "failures", {}).values()] or [str(error)]
        raise ValueError(f"cannot read the checkpoint directory {str(path)!r}: {_first_line(causes[-1])}") from None
    state.update((key, DcpSource(Path(path), key)) for key in left)
    meta = Path(path) / LIGHTNING_META_FILE
    if meta.is_file():
        state.update(torch.load(meta, map_location="cpu", weights_only=False))
    return state


LIGHTNING_VERSION_KEY = "pytorch-lightning_version"


def as_lightning_checkpoint(whole: dict[str, Any], lightning_version: str) -> dict[str, Any]:
    """A checkpoint read by ``read_dcp`` in the layout the Trainer restores: Lightning's sharded FSDP checkpoints
    keep the model under ``model`` and each optimizer under ``optimizer_<index>``; a plain ``dcp.save`` of
    ``{"model": ..., "optim": ...}`` (FSDP2's docs) gives the model and one optimizer, and no training position
    (a fit starts from step 0 with them), so it is marked as of ``lightning_version``: nothing to migrate."""
    if "state_dict" in whole:
        return whole
    if "model" not in whole:
        raise ValueError(
            f"this checkpoint directory holds {sorted(whole)[:6]} but no model: the Trainer reads the model's state "
            "under 'model' (Lightning's sharded checkpoints, or dcp.save({'model': get_model_state_dict(model)}))"
        )
    checkpoint = dict(whole)
    checkpoint["state_dict"] = checkpoint.pop("model")
    numbered = sorted((key for key in checkpoint if key.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    optimizers = [checkpoint.pop(key) for key in numbered] or [
        checkpoint.pop(key) for key in ("optim", "optimizer") if key in checkpoint
    ]
    if optimizers:
        checkpoint["optimizer_states"] = optimizers
        checkpoint.setdefault("lr_schedulers", [])  # none saved: a scheduler starts afresh
    checkpoint.setdefault(LIGHTNING_VERSION_KEY, lightning_version)
    return checkpoint


def by_parameter_index(saved: Mapping[str, Any], optimizer: Optimizer, model: Module) -> dict[str, Any]:
    """``saved`` optimizer state in the layout ``optimizer.load_state_dict`` takes: as it is when its param groups
    list indices; by the parameters' names in ``model`` when they list names (DCP's layout)."""
    groups = saved.get("param_groups", [])
    if not any(isinstance(name, str) for group in groups for name in group.get("params", [])):
        return dict(saved)
    names = saved_names(model)
    ours = [group["params"] for group in optimizer.param_groups]
    if len(groups) != len(ours):
        raise ValueError(
            f"the checkpoint's optimizer state has {len(groups)} param groups, this optimizer {len(ours)}: build "
            "the optimizer with the param groups of the run that saved it"
        )
    state: dict[int, Any] = {}
    converted = []
    index = 0
    for group_index, (group, params) in enumerate(zip(groups, ours, strict=True)):
        wanted = [names.get(id(p)) for p in params]
        if set(wanted) != set(group["params"]):
            missing = sorted(set(group["params"]) - {n for n in wanted if n is not None})[:3]
            extra = sorted({n for n in wanted if n is not None} - set(group["params"]))[:3]
            raise ValueError(
                f"param group {group_index} of the checkpoint's optimizer state holds other parameters than this "
                f"optimizer's: only in the checkpoint {missing}, only here {extra}"
            )
        indices = []
        for name in wanted:
            if name in saved.get("state", {}):
                state[index] = saved["state"][name]
            indices.append(index)
            index += 1
        converted.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": converted}


def by_parameter_name(state: Mapping[str, Any], optimizer: Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` (keyed by index) in DCP's layout, keyed by the names (``saved_names``) of the
    parameters it steps: ``by_parameter_index``'s inverse."""
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    unnamed = [index for index, p in enumerate(ordered) if id(p) not in names]
    if unnamed:
        raise ValueError(
            f"{type(optimizer).__name__} steps {len(unnamed)} parameter(s) the model does not hold (indices "
            f"{unnamed[:4]}): a sharded checkpoint names optimizer state by the model's parameter names, so save "
            "the optimizer with the model whose parameters it steps"
        )
    named = [names[id(p)] for p in ordered]
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [named[i] for i in group["params"]]}
        for group in state["param_groups"]
    ]
    return {"state": {named[int(i)]: values for i, values in state["state"].items()}, "param_groups": groups}


def saved_names(model: Module) -> dict[int, str]:
    """Each parameter's name as ``get_optimizer_state_dict`` keys it (the first of a tied weight's names, a compiled
    model's prefix dropped), by id."""
    return {id(p): name.replace(COMPILED_PREFIX, "") for name, p in model.named_parameters()}


def _first_line(text: str) -> str:
    """The first line of an error's text, as much of it as a message should quote."""
    return (text.strip() or "no reason given").splitlines()[0][:300]


def restore(
    state: Module | Optimizer | dict[str, Any],
    checkpoint: dict[str, Any],
    strict: bool,
    load_module: Callable[[Module, Any, bool], None],
    load_optimizer: Callable[[Optimizer, Any, Module], None],
) -> dict[str, Any]:
    """``state``'s objects given their parts of ``checkpoint`` (read by ``read_dcp``), as Fabric's ``load`` gives
    them from a file: a module through ``load_module``, an optimizer through ``load_optimizer`` with the module in
    ``state`` whose parameters it steps (its state is keyed by their names), anything else with a
    ``load_state_dict`` through it, plain values replaced. Returns what is left of the checkpoint."""
    if isinstance(state, Module):
        load_module(state, checkpoint, strict)
        return {}
    if isinstance(state, Optimizer):
        load_optimizer(state, checkpoint, Module())
        return {}
    missing = [name for name in state if name not in checkpoint]
    if strict and missing:
        raise KeyError(
            f"the requested state names {missing} that the checkpoint does not hold (it holds {sorted(checkpoint)}); "
            "pass strict=False to load the rest"
        )
    modules = [obj for obj in state.values() if isinstance(obj, Module)]
    for name, obj in list(state.items()):
        if name not in checkpoint:
            continue
        if isinstance(obj, Module):
            load_module(obj, checkpoint.pop(name), strict)
        elif isinstance(obj, Optimizer):
            load_optimizer(obj, checkpoint.pop(name), _stepped_by(obj, modules))
        elif callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(checkpoint.pop(name))
        else:
            state[name] = checkpoint.pop(name)
    return checkpoint


def _stepped_by(optimizer: Optimizer, modules: list[Module]) -> Module:
    """The module whose parameters ``optimizer`` steps (the first that holds one of them)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        if any(id(p) in stepped for p in module.parameters()):
            return module
    return Module()  # no names: a checkpoint keyed by names then says which parameters it misses
