"""Copies of training state in host memory: what an elastic commit keeps while training goes on, and the parts of
it each worker keeps of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvd_plugins.core.sync.base import OWN_PARTS_KEY


def host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to CPU memory (dicts, lists and tuples rebuilt, the rest kept).

    A checkpoint dict refers to the live parameters and optimizer state; the copy does not change
    when they do, and holds no GPU memory.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = {key: host_copy(item) for key, item in value.items()}
        if type(value) is dict:
            return copied
        try:
            return type(value)(copied)  # OrderedDict (state dicts), AttributeDict (hyperparameters)
        except TypeError:
            return copied
    if isinstance(value, list):
        return [host_copy(item) for item in value]
    if isinstance(value, tuple):
        return tuple(host_copy(item) for item in value)
    return value


def rescale_learning_rates(checkpoint: dict[str, Any], factor: float) -> None:
    """Multiply the learning rates a Lightning checkpoint holds (optimizers and schedulers) by ``factor``."""
    for optimizer_state in checkpoint.get("optimizer_states", []):
        for group in optimizer_state.get("param_groups", []):
            for key in ("lr", "initial_lr"):
                if isinstance(group.get(key), (int, float)):
                    group[key] = group[key] * factor
    for scheduler_state in checkpoint.get("lr_schedulers", []):
        for key in ("base_lrs", "_last_lr"):
            if isinstance(scheduler_state.get(key), list):
                scheduler_state[key] = [lr * factor for lr in scheduler_state[key]]


def take_own_parts(checkpoint: dict[str, Any]) -> list[Any]:
    """Take this worker's own parts (``OWN_PARTS_KEY``) out of a commit's optimizer states, leaving an empty place:
    the rest of the commit is rank 0's for every worker. One entry per optimizer, None where it keeps none."""
    taken: list[Any] = []
    for state in checkpoint.get("optimizer_states", []):
        own = isinstance(state, dict) and OWN_PARTS_KEY in state
        taken.append(state[OWN_PARTS_KEY] if own else None)
        if own:
            state[OWN_PARTS_KEY] = None
    return taken


def give_own_parts(checkpoint: dict[str, Any], taken: Sequence[Any] | None) -> None:
    """Put this worker's own parts back into the places ``take_own_parts`` left (an empty mapping where it holds
    none: a worker that joined, or one whose parts belong to another commit)."""
    for index, state in enumerate(checkpoint.get("optimizer_states", [])):
        if isinstance(state, dict) and OWN_PARTS_KEY in state:
            mine = taken[index] if taken is not None and index < len(taken) else None
            state[OWN_PARTS_KEY] = dict(mine) if mine is not None else {}
