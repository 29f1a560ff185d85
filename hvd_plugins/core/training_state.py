"""Keeping model and optimizer state identical across workers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Module, Parameter
from torch.optim import Optimizer

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.buffers import finish_buffer_average, start_buffer_average
from hvd_plugins.core.comm.gradient_sync import GradientSync
from hvd_plugins.core.comm.parameters import indexed_optimizer_parameters


def named_parameters_for(optimizer: Optimizer, model: Module, prefix: str) -> list[tuple[str, Parameter]]:
    """Unique allreduce names for one optimizer's parameters.

    Horovod matches collectives by name, so two optimizers over one model need distinct names:
    each name is prefixed with the optimizer's index. Parameters not owned by the model get
    positional names.
    """
    model_names = {id(parameter): name for name, parameter in model.named_parameters()}
    named = []
    for group_index, position, parameter in indexed_optimizer_parameters(optimizer):
        name = model_names.get(id(parameter), f"group{group_index}.param{position}")
        named.append((f"{prefix}.{name}", parameter))
    return named


def average_buffers_(model: Module, name: str) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over all workers, in place.

    Blocking form of ``comm.buffers``' start/finish pair (which DASO overlaps with its own sync).
    """
    finish_buffer_average(start_buffer_average(model, name))


def wrap_optimizers(
    sync: GradientSync,
    optimizers: Sequence[Optimizer],
    model: Module,
    schedulers: Sequence[Any] = (),
    first_index: int = 0,
) -> list[Optimizer]:
    """Each optimizer as ``sync`` wraps it (named ``opt<i>.<parameter>``, ``i`` from ``first_index``: a loop that
    sets up optimizers in several calls keeps their names apart), and schedulers pointed at the wrappers."""
    wrapped = [
        sync.wrap(optimizer, named_parameters_for(optimizer, model, f"opt{index}"))
        for index, optimizer in enumerate(optimizers, start=first_index)
    ]
    for scheduler in schedulers:
        if scheduler.optimizer in optimizers:
            scheduler.optimizer = wrapped[list(optimizers).index(scheduler.optimizer)]
    return wrapped


def broadcast_optimizer_states_(optimizers: Sequence[Optimizer], root_rank: int) -> None:
    """Every optimizer's state as ``root_rank`` holds it (after a checkpoint restore), named by position."""
    for index, optimizer in enumerate(optimizers):
        broadcast_optimizer_state_(optimizer, root_rank=root_rank, name=f"opt{index}")


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


def scale_learning_rates_(optimizers: Sequence[Optimizer], schedulers: Sequence[Any], factor: float) -> None:
    """Multiply every learning rate, and the base lrs schedulers restart from, by ``factor``."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
    for scheduler in schedulers:
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
