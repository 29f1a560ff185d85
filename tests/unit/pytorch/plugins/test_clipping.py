"""Lightning's clipping goes through the sync mode once there is one, and through the plugin's own before."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.pytorch.plugins.clipping import clip_through_sync


class RecordingSync(GradientSync):
    """Records the clips it was asked for, and clips as the base does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to average in one process."""

    def clip_grad_norm_(
        self, optimizer: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Any:
        self.calls.append(("norm", max_norm))
        return super().clip_grad_norm_(optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_grad_value_(self, optimizer: Any, clip_value: float) -> None:
        self.calls.append(("value", clip_value))
        super().clip_grad_value_(optimizer, clip_value)


def gradients_of_ones() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    parameter = torch.nn.Parameter(torch.zeros(4))
    parameter.grad = torch.full((4,), 3.0)
    return parameter, torch.optim.SGD([parameter], lr=1.0)


def test_clipping_asks_the_sync_mode_and_clips_as_lightning_would() -> None:
    precision, sync = Precision(), RecordingSync()
    current: list[GradientSync | None] = [None]
    clip_through_sync(precision, lambda: current[0])
    parameter, optimizer = gradients_of_ones()
    precision.clip_gradients(optimizer, clip_val=12.0, gradient_clip_algorithm="norm")  # before the sync: Lightning's
    assert torch.equal(parameter.grad, torch.full((4,), 3.0)) and sync.calls == []  # norm 6 < 12: untouched
    current[0] = sync
    precision.clip_gradients(optimizer, clip_val=3.0, gradient_clip_algorithm="norm")
    torch.testing.assert_close(parameter.grad, torch.full((4,), 1.5), rtol=0, atol=1e-5)  # scaled to norm 3
    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm="value")
    assert torch.equal(parameter.grad, torch.ones(4)) and sync.calls == [("norm", 3.0), ("value", 1.0)]
