"""Keeping model and optimizer state identical across workers."""

from __future__ import annotations

import torch
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from hvd_plugins._horovod import horovod_torch


def named_parameters_for(optimizer: Optimizer, model: Module, prefix: str) -> list[tuple[str, Parameter]]:
    """Unique allreduce names for one optimizer's parameters.

    Horovod matches collectives by name, so two optimizers over one model need distinct names:
    each name is prefixed with the optimizer's index. Parameters not owned by the model get
    positional names.
    """
    model_names = {id(parameter): name for name, parameter in model.named_parameters()}
    named = []
    for group_index, group in enumerate(optimizer.param_groups):
        for position, parameter in enumerate(group["params"]):
            name = model_names.get(id(parameter), f"group{group_index}.param{position}")
            named.append((f"{prefix}.{name}", parameter))
    return named


def average_buffers_(model: Module, name: str) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over all workers, in place."""
    hvd = horovod_torch()
    handles = []
    for buffer_name, buffer in model.named_buffers():
        if buffer.is_floating_point() and buffer.dtype != torch.bfloat16:
            handles.append((buffer, hvd.allreduce_async(buffer.detach(), op=hvd.Average, name=f"{name}.{buffer_name}")))
    for buffer, handle in handles:
        buffer.copy_(hvd.synchronize(handle))


def broadcast_optimizer_state_(optimizer: Optimizer, root_rank: int, name: str) -> None:
    """Make every worker's optimizer state (and hyper-parameters) equal to ``root_rank``'s.

    Unlike ``hvd.broadcast_optimizer_state`` this never runs a dummy optimizer step, so weight
    decay or step counters are not disturbed when the state is still empty.
    """
    hvd = horovod_torch()
    if hvd.size() == 1:
        return
    state = hvd.broadcast_object(
        optimizer.state_dict() if hvd.rank() == root_rank else None, root_rank=root_rank, name=f"{name}.state"
    )
    if hvd.rank() != root_rank:
        optimizer.load_state_dict(state)
