"""The Trainer's gradient clipping, answered by the sync mode: it knows which averaged gradients a worker holds.

Lightning clips through its precision plugin (``clip_grad_by_norm``, ``clip_grad_by_value``) over every
parameter of the optimizer. Under a sharded mode a worker holds only its slices of the averaged
gradients, and the norm over the whole model takes one collective over the slices; so the strategy
hands both to the sync mode (``GradientSync.clip_grad_norm_``, ``clip_grad_value_``), which for the
modes that hold every gradient does what Lightning does. The plugin's own methods stay in charge
before the sync exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from hvd_plugins.core.sync.base import GradientSync


def clip_through_sync(precision: Precision, current_sync: Callable[[], GradientSync | None]) -> None:
    """Let ``precision``'s clipping go through the sync mode ``current_sync()`` returns (asked at every clip)."""
    by_norm, by_value = type(precision).clip_grad_by_norm, type(precision).clip_grad_by_value

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float) -> None:
        sync = current_sync()
        if sync is None:
            return by_norm(precision, optimizer, clip_val)
        sync.clip_grad_norm_(optimizer, float(clip_val))
        return None

    def clip_grad_by_value(optimizer: Optimizer, clip_val: int | float) -> None:
        sync = current_sync()
        if sync is None:
            return by_value(precision, optimizer, clip_val)
        return sync.clip_grad_value_(optimizer, float(clip_val))

    routed: Any = precision  # an instance's own methods, set once per setup
    routed.clip_grad_by_norm = clip_grad_by_norm
    routed.clip_grad_by_value = clip_grad_by_value
