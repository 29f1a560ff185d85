"""The gradients a worker hands to a collective: dense, zero-filled where backward produced none."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer

from hvd_plugins.core.comm.parameters import optimizer_parameters


def gradient_to_send(parameter: torch.Tensor) -> torch.Tensor:
    """The gradient a worker hands to a sum for ``parameter``: dense, and zeros where backward produced none.

    Every worker must hand the same tensors to the collective, even when a parameter got no
    gradient on this worker (e.g. an unused branch): a trainable one gets a zero gradient, as under
    DDP; a frozen one (buckets built before it was frozen) sends zeros and keeps no gradient. Sparse
    gradients (``nn.Embedding(sparse=True)``) become dense: the node-aware syncs flatten gradients
    into buckets.
    """
    if parameter.grad is None:
        if not parameter.requires_grad:
            return torch.zeros_like(parameter)
        parameter.grad = torch.zeros_like(parameter)
    elif parameter.grad.is_sparse:
        parameter.grad = parameter.grad.to_dense()
    return parameter.grad


def gradients_of(optimizer: Optimizer) -> Sequence[torch.Tensor]:
    """Gradients of every trainable parameter, zero-filled where none was produced, dense (``gradient_to_send``)."""
    return [gradient_to_send(parameter) for parameter in optimizer_parameters(optimizer, trainable_only=True)]


def divide_gradients_(optimizer: Optimizer, divisor: int) -> None:
    """Divide the gradients of ``optimizer``'s trainable parameters in place: a settled ``op="sum"`` sum that the
    step sums over every worker once more."""
    for parameter in optimizer_parameters(optimizer, trainable_only=True):
        if parameter.grad is not None:
            parameter.grad.div_(divisor)
