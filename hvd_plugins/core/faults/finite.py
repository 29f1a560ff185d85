"""Stop every rank at once at the first step whose gradients hold NaN or Inf."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.parameters import optimizer_parameters


class NonFiniteGradientError(FloatingPointError):
    """Gradients held NaN or Inf; raised with the same message on every rank."""


class FiniteGradientCheck:
    """Stop training at the first step whose gradients are not finite, on every rank at once.

    A tensor hook on every parameter marks this rank when a local (not yet averaged) gradient
    is NaN/Inf; after the average, one allreduce of a ``2 * world_size`` vector tells every rank
    which ranks produced non-finite local gradients and whose averaged gradients are
    non-finite. All ranks see the same vector, so all raise the same error and none is left
    waiting in a collective. An allreduce (not an allgather) keeps it safe next to ``hvd.join``.
    """

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        self._hvd = horovod_torch()
        self._flags: dict[int, Tensor] = {}  # id(optimizer) -> bool scalar: a local gradient was non-finite
        self._handles: list[RemovableHandle] = []
        for optimizer in optimizers:
            parameters = optimizer_parameters(optimizer, trainable_only=True)
            if not parameters:
                continue
            flag = torch.zeros((), dtype=torch.bool, device=parameters[0].device)
            self._flags[id(optimizer)] = flag
            for parameter in parameters:
                self._handles.append(parameter.register_hook(_mark_non_finite(flag)))

    def after_average(self, optimizer: Optimizer, averaged: Sequence[Tensor], where: str) -> None:
        """Collective on every rank: raise NonFiniteGradientError if any rank saw a non-finite gradient.

        ``averaged``: the averaged gradients this rank owns (all of them, unless its sync mode shards them).
        """
        flag = self._flags.get(id(optimizer))
        if flag is None:
            return
        hvd = self._hvd
        size, rank = hvd.size(), hvd.rank()
        averaged_bad = torch.zeros((), dtype=torch.bool, device=flag.device)
        for gradient in averaged:
            averaged_bad.logical_or_(~torch.isfinite(gradient).all())
        votes = torch.zeros(2 * size, dtype=torch.float32)
        votes[rank] = float(flag.item())  # one device sync per step
        votes[size + rank] = float(averaged_bad.item())
        flag.zero_()
        if size > 1:
            votes = hvd.allreduce(votes, op=hvd.Sum, name="hvd_plugins.finite_gradients")
        local_ranks = [r for r in range(size) if votes[r] > 0]
        averaged_ranks = [r for r in range(size) if votes[size + r] > 0]
        if local_ranks or averaged_ranks:
            origin = (
                f"local gradients were NaN/Inf on rank(s) {local_ranks}"
                if local_ranks
                else f"local gradients were finite but their average overflowed on rank(s) {averaged_ranks}"
            )
            raise NonFiniteGradientError(
                f"Non-finite gradients at {where}: {origin} (of {size} worker(s)). Training stopped on every "
                "rank before the optimizer step, so the weights are still finite. Lower the learning rate, clip "
                "gradients, or look at the loss on those ranks; check_finite_gradients=False turns this check off."
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._flags.clear()


def _mark_non_finite(flag: Tensor) -> Any:
    def hook(gradient: Tensor) -> None:
        flag.logical_or_(~torch.isfinite(gradient).all())  # stays on the device: no sync per parameter

    return hook


def require_no_grad_scaler(precision_plugin: Any) -> None:
    """check_finite_gradients and a GradScaler disagree: the scaler skips inf/NaN steps by design."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "check_finite_gradients=True cannot be combined with a GradScaler (precision='16-mixed' on GPU): the "
            "scaler expects occasional inf/NaN gradients and skips those steps, identically on every rank because "
            "gradients are averaged before unscaling. Drop check_finite_gradients, or use precision='bf16-mixed'/32."
        )
