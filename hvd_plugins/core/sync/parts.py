"""Optimizer state saved in parts, one file per worker, and the parts made whole again.

``shard_checkpoint="parts"`` is for models whose whole optimizer state does not fit one worker:
each worker writes its slices (``optimizer_part``) beside the checkpoint, named by ``part_path``,
and the checkpoint itself holds a marker instead of the state. A job of the same number of workers
and buckets loads its own part; any other (another number of workers, one process) needs the whole
state, which ``consolidate`` makes from every part: ``python -m hvd_plugins.consolidate CKPT``.

The format belongs to no one mode: a mode whose ``optimizer_state_dict`` gives parts has them written
(``write_parts_beside``), and a checkpoint saved in parts loads under any mode (``read_parts_beside``),
so the strategies save and load without asking which mode runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import torch

from hvd_plugins.core.comm.layout import FlatLayout

PART_FORMAT = "hvd_plugins.optimizer_part/1"
"""Marks one worker's part of one optimizer's state."""
PARTS_MARKER = "hvd_plugins.optimizer_parts/1"
"""What a checkpoint holds in place of its optimizer states when they were saved in parts."""


def part_path(checkpoint: str | Path, rank: int, workers: int) -> Path:
    """Where worker ``rank`` of ``workers`` writes its part of the optimizer states of ``checkpoint``."""
    return Path(f"{checkpoint}.optimizer-part-{rank}-of-{workers}")


def is_part(state: object) -> TypeGuard[Mapping[str, Any]]:
    return isinstance(state, Mapping) and state.get("format") == PART_FORMAT


def is_parts_marker(states: object) -> TypeGuard[Mapping[str, Any]]:
    return isinstance(states, Mapping) and states.get("format") == PARTS_MARKER


def parts_marker(workers: int, optimizers: int) -> dict[str, Any]:
    return {"format": PARTS_MARKER, "workers": workers, "optimizers": optimizers}


def read_parts(
    checkpoint: str | Path, workers: int, rank: int | None = None, mmap: bool = False
) -> list[dict[str, Any]]:
    """The part files saved with ``checkpoint`` by ``workers`` workers (only ``rank``'s when given), in rank order;
    each holds ``{"optimizer_parts": [one part per optimizer]}``. ``mmap``: their tensors mapped from the files,
    read as they are used, not loaded."""
    ranks = range(workers) if rank is None else [rank]
    found = []
    for each in ranks:
        path = part_path(checkpoint, each, workers)
        if not path.exists():
            raise FileNotFoundError(
                f"{checkpoint} was saved in parts by {workers} workers, but {path} is missing: keep every part "
                "file beside the checkpoint (shard_checkpoint='parts')"
            )
        found.append(torch.load(path, map_location="cpu", weights_only=False, mmap=mmap))
    return found


Allocate = Callable[[int, torch.dtype], torch.Tensor]
"""Where a consolidated tensor of ``count`` elements lives: in memory (``in_memory``), or in a file."""


def in_memory(count: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(count, dtype=dtype)


def consolidate(parts: Sequence[Mapping[str, Any]], allocate: Allocate = in_memory) -> dict[str, Any]:
    """The whole optimizer state (the format of the user's optimizer) from every worker's part, in any order; each
    of its tensors made by ``allocate``."""
    ordered = sorted(parts, key=lambda part: part["rank"])
    workers = ordered[0]["workers"]
    if not all(is_part(part) for part in ordered) or [p["rank"] for p in ordered] != list(range(workers)):
        raise ValueError(
            f"consolidating needs one part from each of the {workers} workers, got ranks "
            f"{[p.get('rank') for p in ordered]}"
        )
    state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in ordered[0]["parked"].items()}
    for index, bucket in enumerate(ordered[0]["buckets"]):
        for key, value in bucket["state"].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                pieces = [part["buckets"][index]["state"][key] for part in ordered]
                for parameter, whole in per_parameter(bucket, pieces, allocate):
                    state.setdefault(parameter, {})[key] = whole
            else:
                for parameter in bucket["parameters"]:
                    state.setdefault(parameter, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return {"state": state, "param_groups": [dict(group) for group in ordered[0]["param_groups"]]}


def per_parameter(
    bucket: Mapping[str, Any], pieces: Sequence[torch.Tensor], allocate: Allocate = in_memory
) -> Iterator[tuple[int, torch.Tensor]]:
    """Each parameter of a part's ``bucket`` (its state index) and its whole tensor, joined from the workers' equal
    ``pieces`` of the bucket's flat layout, one parameter at a time."""
    layout = FlatLayout([torch.Size(shape) for shape in bucket["shapes"]])
    for parameter, (offset, count, shape) in zip(bucket["parameters"], layout.spans(), strict=True):
        yield int(parameter), joined(pieces, offset, count, allocate).reshape(shape)


def joined(pieces: Sequence[torch.Tensor], start: int, count: int, allocate: Allocate = in_memory) -> torch.Tensor:
    """Elements ``start`` to ``start + count`` of the workers' equal ``pieces`` laid end to end, copied into one new
    tensor from ``allocate``: no whole bucket is ever made, only what one parameter holds."""
    whole = allocate(count, pieces[0].dtype)
    size = pieces[0].numel()
    copied = 0
    while copied < count:
        piece, inside = divmod(start + copied, size)
        take = min(size - inside, count - copied)
        whole[copied : copied + take].copy_(pieces[piece][inside : inside + take])
        copied += take
    return whole


def consolidate_checkpoint(path: str | Path, allocate: Allocate = in_memory) -> dict[str, Any]:
    """A checkpoint saved in parts, with its optimizer states made whole, each tensor by ``allocate``. The checkpoint
    and the part files are memory-mapped: besides what ``allocate`` gives, this takes one parameter's state at a
    time."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    marker = checkpoint.get("optimizer_states")
    if not is_parts_marker(marker):
        raise ValueError(
            f"{path} holds whole optimizer states already (it was not saved with shard_checkpoint='parts')"
        )
    per_worker = [parts["optimizer_parts"] for parts in read_parts(path, marker["workers"], mmap=True)]
    checkpoint["optimizer_states"] = [
        consolidate([parts[index] for parts in per_worker], allocate) for index in range(marker["optimizers"])
    ]
    return checkpoint


def write_parts_beside(
    checkpoint: dict[str, Any], filepath: str | Path, save: Callable[[dict[str, Any], Path], None]
) -> None:
    """Where ``checkpoint``'s optimizer states are this worker's parts: ``save`` them beside ``filepath`` (every
    worker calls this) and leave a marker in their place in ``checkpoint`` (which rank 0 then writes).

    Where the parts have copies on other nodes (sharded inside the node, ``copy`` > 0), node 0's are written.
    """
    states = checkpoint.get("optimizer_states", [])
    if not states or not all(is_part(state) for state in states):
        return
    rank, workers = states[0]["rank"], states[0]["workers"]
    if not states[0].get("copy", 0):
        save({"optimizer_parts": states}, part_path(filepath, rank, workers))
    checkpoint["optimizer_states"] = parts_marker(workers, len(states))


def read_parts_beside(checkpoint: dict[str, Any], filepath: str | Path, world_size: int, rank: int) -> None:
    """Where ``checkpoint`` was saved in parts: put back this worker's own parts where the workers are as many as
    when it was saved, else the whole states, consolidated from every part (mapped from disk: the whole states
    are the only copy this worker makes)."""
    marker = checkpoint.get("optimizer_states")
    if not is_parts_marker(marker):
        return
    workers = marker["workers"]
    if workers == world_size:
        checkpoint["optimizer_states"] = read_parts(filepath, workers, rank)[0]["optimizer_parts"]
        return
    per_worker = [parts["optimizer_parts"] for parts in read_parts(filepath, workers, mmap=True)]
    checkpoint["optimizer_states"] = [
        consolidate([parts[index] for parts in per_worker]) for index in range(marker["optimizers"])
    ]
