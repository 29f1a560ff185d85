"""BatchNorm whose batch statistics span all workers, on CPU and GPU.

Horovod's own ``hvd.SyncBatchNorm`` accepts only CUDA inputs. This one computes per-channel
sums with Horovod's differentiable allreduce, so autograd produces the synchronized backward
(the allreduce of the gradient sums) by itself.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.naming import COLLECTIVE_NAMES

AnyBatchNorm = TypeVar("AnyBatchNorm", bound=_BatchNorm)


class _NamedSumAllreduce(torch.autograd.Function):
    """A differentiable Sum whose backward allreduce is named too.

    Horovod's own differentiable allreduce leaves its backward op unnamed, so it is named after a
    per-process counter that drifts apart once ranks ran different numbers of batches (uneven data,
    ``hvd.join``), and the next epoch's backward deadlocks. Both names here come from
    ``COLLECTIVE_NAMES``, which all ranks resynchronize at every epoch end.
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, kind: str) -> Tensor:
        ctx.name = COLLECTIVE_NAMES.next(kind)
        hvd = horovod_torch()
        return hvd.allreduce(tensor, op=hvd.Sum, name=ctx.name)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        hvd = horovod_torch()
        return hvd.allreduce(grad.contiguous(), op=hvd.Sum, name=f"{ctx.name}.grad"), None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``BatchNorm{1,2,3}d`` that normalizes with statistics of the global batch."""

    replaced_type: type[_BatchNorm] = torch.nn.BatchNorm1d
    """The layer class this one replaced; ``revert_sync_batchnorm`` brings it back."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        hvd = horovod_torch()
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or hvd.size() == 1:
            return super().forward(input)

        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        dims = [0, *range(2, x.dim())]
        count = x.new_full((x.size(1),), float(x.numel() // x.size(1)))
        # One round for sums, sums of squares and the sample count; backward allreduces the grad sums.
        total = _NamedSumAllreduce.apply(torch.stack([x.sum(dims), (x * x).sum(dims), count]), "sync_bn")
        n = float(total[2, 0].detach())  # a count: no gradient flows through it
        mean = total[0] / n
        var = (total[1] / n - mean * mean).clamp_min(0.0)

        tracked = self.num_batches_tracked
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            assert tracked is not None  # BatchNorm keeps the count whenever it tracks running statistics
            with torch.no_grad():
                tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(tracked)
                unbiased = var * (n / max(n - 1.0, 1.0))
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)

        shape = [1, -1] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(input.dtype)


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
    replacement = kind(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
    replacement.load_state_dict(module.state_dict())
    replacement.train(module.training)
    floating = [tensor for tensor in module.state_dict().values() if tensor.is_floating_point()]
    reference = floating[0] if floating else torch.empty(0)
    return replacement.to(device=reference.device, dtype=reference.dtype)  # keep the precision's dtype
