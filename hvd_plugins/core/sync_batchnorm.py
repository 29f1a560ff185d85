"""BatchNorm whose batch statistics span all workers, on CPU and GPU.

Horovod's own ``hvd.SyncBatchNorm`` accepts only CUDA inputs. This one computes per-channel
sums with a differentiable allreduce, so autograd produces the synchronized backward (the
allreduce of the gradient sums) by itself. From torch 2.4 that allreduce is a torch library op,
so a ``torch.compile``-d model holds each BatchNorm's sums as one node of its graph, not a break.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.naming import COLLECTIVE_NAMES

AnyBatchNorm = TypeVar("AnyBatchNorm", bound=_BatchNorm)


class _NamedSumAllreduce(torch.autograd.Function):
    """A differentiable Sum whose backward allreduce is named too (torch before 2.4; compiled, it breaks the graph).

    Horovod's own differentiable allreduce leaves its backward op unnamed, so it is named after a
    per-process counter that drifts apart once ranks ran different numbers of batches (uneven data,
    ``hvd.join``), and the next epoch's backward deadlocks. Both names here come from
    ``COLLECTIVE_NAMES``, which all ranks resynchronize at every epoch end.
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, kind: str) -> Tensor:
        return _named_sum(tensor, kind)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _named_sum(grad.contiguous(), "sync_bn.grad"), None


def _named_sum(tensor: Tensor, kind: str) -> Tensor:
    """The sum over every worker, under a name from ``COLLECTIVE_NAMES`` (equal on every rank)."""
    hvd = horovod_torch()
    return hvd.allreduce(tensor, op=hvd.Sum, name=COLLECTIVE_NAMES.next(kind))


def _sum_op() -> Callable[[Tensor, str], Tensor]:
    """The differentiable named sum; from torch 2.4 a torch library op, which a compiled graph calls as one opaque
    node (Horovod's functions are not torch ops: traced into, they would break the graph at every BatchNorm)."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return _NamedSumAllreduce.apply

    @custom_op("hvd_plugins::sum_over_workers", mutates_args=())
    def sum_over_workers(tensor: Tensor, kind: str) -> Tensor:
        return _named_sum(tensor, kind)

    @sum_over_workers.register_fake
    def _(tensor: Tensor, kind: str) -> Tensor:
        return torch.empty_like(tensor)

    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return sum_over_workers(grad.contiguous(), "sync_bn.grad"), None

    sum_over_workers.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)
    return sum_over_workers


_sum_over_workers = _sum_op()


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``BatchNorm{1,2,3}d`` that normalizes with statistics of the global batch."""

    replaced_type: type[_BatchNorm] = torch.nn.BatchNorm1d
    """The layer class this one replaced; ``revert_sync_batchnorm`` brings it back."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or not self.track_running_stats
        # Compiled, the graph always sums (a sum over one worker is its own): it holds no call into Horovod.
        if not use_batch_stats or (not _compiling() and horovod_torch().size() == 1):
            return super().forward(input)

        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        dims = [0, *range(2, x.dim())]
        count = x.new_full((x.size(1),), float(x.numel() // x.size(1)))
        # One round for sums, sums of squares and the sample count; backward allreduces the grad sums.
        total = _sum_over_workers(torch.stack([x.sum(dims), (x * x).sum(dims), count]), "sync_bn")
        n = total[2, 0].detach()  # a count: no gradient flows through it (a tensor: no graph break when compiled)
        mean = total[0] / n
        var = (total[1] / n - mean * mean).clamp_min(0.0)

        tracked = self.num_batches_tracked
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            assert tracked is not None  # BatchNorm keeps the count whenever it tracks running statistics
            with torch.no_grad():
                tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / tracked
                unbiased = var * (n / (n - 1.0).clamp_min(1.0))
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype) * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype) * momentum)

        shape = [1, -1] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(input.dtype)


def _compiling() -> bool:
    """Whether ``torch.compile`` is tracing this call (dynamo folds the answer into the graph)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def convert_sync_batchnorm(module: Module) -> Module:
    """Replace every BatchNorm layer in ``module`` by ``SyncBatchNorm``, keeping its state."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        replacement = _replace(module, SyncBatchNorm)
        replacement.replaced_type = type(module)
        return replacement
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module


def revert_sync_batchnorm(module: Module) -> Module:
    """Undo ``convert_sync_batchnorm``: every ``SyncBatchNorm`` becomes the layer it replaced, state kept."""
    if isinstance(module, SyncBatchNorm):
        return _replace(module, module.replaced_type)
    for name, child in module.named_children():
        module.add_module(name, revert_sync_batchnorm(child))
    return module


def _replace(module: _BatchNorm, kind: type[AnyBatchNorm]) -> AnyBatchNorm:
    """A ``kind`` layer that takes over ``module``'s own parameters and buffers (the same tensors, so an optimizer,
    a sharded unit or an elastic placeholder that holds them sees no change)."""
    with torch.device("meta"):  # its own tensors are replaced at once: none is allocated
        replacement = kind(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
    replacement._parameters = dict(module._parameters)
    replacement._buffers = dict(module._buffers)
    replacement._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    replacement.train(module.training)
    return replacement
