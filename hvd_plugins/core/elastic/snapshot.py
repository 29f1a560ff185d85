"""Copies of training state in host memory: what an elastic commit keeps while training goes on."""

from __future__ import annotations

from typing import Any

import torch


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
