"""Activation checkpointing (``activation_checkpointing_policy``): the modules the policy picks keep no activations
for backward and run their forward again when backward reaches them.

Each picked module's ``forward`` is wrapped in torch's non-reentrant ``checkpoint`` on the instance, so its hooks,
its name and its state dict stay as they were: a sharded unit's hooks still gather its parameters around the
forward, and its gradient hooks gather them again before backward recomputes it.
"""

from __future__ import annotations

import functools
from typing import Any

from torch.nn import Module
from torch.utils.checkpoint import checkpoint

from hvd_plugins.core.config import UnitPolicy, policy_picks

WRAPPED = "_hvd_plugins_recomputed_forward"
"""Attribute holding a checkpointed module's own forward (so that a second setup does not wrap it twice)."""


def checkpoint_activations(model: Module, policy: UnitPolicy) -> list[str]:
    """Wrap the forward of every module under ``model`` that ``policy`` picks (the model itself never); the names."""
    if policy is None:
        return []
    picked = []
    for name, module in model.named_modules():
        if module is model or not policy_picks(policy, module):
            continue
        picked.append(name)
        if WRAPPED in module.__dict__:
            continue  # checkpointed at an earlier setup
        own_forward = module.forward
        setattr(module, WRAPPED, own_forward)
        module.forward = functools.partial(_recomputed, own_forward)
    if not picked:
        raise ValueError(
            f"activation_checkpointing_policy={policy!r} picks no module of {type(model).__name__}: name the "
            "classes of its blocks, for example activation_checkpointing_policy={Block}"
        )
    return picked


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
