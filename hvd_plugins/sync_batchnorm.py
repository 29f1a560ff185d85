"""BatchNorm whose batch statistics span all workers, on CPU and GPU.

Horovod's own ``hvd.SyncBatchNorm`` accepts only CUDA inputs. This one computes per-channel
sums with Horovod's differentiable allreduce, so autograd produces the synchronized backward
(the allreduce of the gradient sums) by itself.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm

from hvd_plugins._horovod import horovod_torch


class HorovodSyncBatchNorm(_BatchNorm):
    """Drop-in for ``BatchNorm{1,2,3}d`` that normalizes with statistics of the global batch."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"HorovodSyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        hvd = horovod_torch()
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or hvd.size() == 1:
            return super().forward(input)

        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        dims = [0, *range(2, x.dim())]
        local = torch.stack([x.sum(dims), (x * x).sum(dims)])
        count = torch.tensor([float(x.numel() // x.size(1))], dtype=torch.float64)
        total = hvd.allreduce(local, op=hvd.Sum)  # differentiable: backward allreduces the grad sums
        n = float(hvd.allreduce(count, op=hvd.Sum).item())
        mean = total[0] / n
        var = (total[1] / n - mean * mean).clamp_min(0.0)

        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (n / max(n - 1.0, 1.0))
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)

        shape = [1, -1] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(input.dtype)


def convert_sync_batchnorm(module: Module) -> Module:
    """Replace every BatchNorm layer in ``module`` by ``HorovodSyncBatchNorm``, keeping its state."""
    if isinstance(module, _BatchNorm) and not isinstance(module, HorovodSyncBatchNorm):
        replacement = HorovodSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        replacement.load_state_dict(module.state_dict())
        replacement.train(module.training)
        return replacement.to(next(iter(module.state_dict().values()), torch.empty(0)).device)
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module
