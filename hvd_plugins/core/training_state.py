"""Keeping model and optimizer state identical across workers."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from hvd_plugins.core.backend.bfloat16 import require_bfloat16_for
from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.buffers import finish_buffer_average, start_buffer_average
from hvd_plugins.core.comm.parameters import indexed_optimizer_parameters
from hvd_plugins.core.comm.world import broadcast_from_root
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.sync.meta import has_meta_tensors, materialize, placeholders_to_meta


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


def broadcast_module_(model: Module) -> None:
    """Give every worker rank 0's parameters and buffers (those on the meta device wait for a sync mode that makes
    them real); a bfloat16 model on a Horovod that cannot send bfloat16 stops here, before the first collective,
    with the command that builds one that can."""
    require_bfloat16_for(model, horovod_torch())
    broadcast_from_root([tensor for tensor in model.state_dict().values() if not tensor.is_meta], "module")


def move_module_(model: Module, device: torch.device) -> None:
    """``model`` to ``device``; a model built on the meta device moves what is real and keeps the rest for later."""
    if not has_meta_tensors(model):
        model.to(device)
        return
    model._apply(lambda tensor: tensor if tensor.is_meta else tensor.to(device))
    for module in model.modules():
        if hasattr(module, "_device"):  # Lightning's modules remember their device
            setattr(module, "_device", device)  # noqa: B010


def shape_placeholders_(model: Module) -> None:
    """After an elastic reset: the units a sharded mode left as placeholders (``shard="parameters"``) take their
    shapes again, on the meta device, so that every worker's model looks alike before the next setup makes them real
    and the commit gives them their values."""
    placeholders_to_meta(model)


def prepare_module_(model: Module, device: torch.device, keep_meta: bool) -> None:
    """The model as training starts it: on ``device``, real and rank 0's on every worker. With ``keep_meta`` the sync
    mode does both a unit at a time (``shard="parameters"``): what is on the meta device stays there, and nothing is
    broadcast here, as workers may differ in what is real (after an elastic reset, placeholders on the survivors,
    a whole model on a worker that joined)."""
    move_module_(model, device)
    if keep_meta:
        require_bfloat16_for(model, horovod_torch())
        return
    if has_meta_tensors(model):
        materialize(model, device)
    broadcast_module_(model)


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
    for optimizer, wrapper in zip(optimizers, wrapped, strict=True):
        mark_steps_for_schedulers(wrapper, optimizer)
    return wrapped


def mark_steps_for_schedulers(wrapper: Optimizer, wrapped: Optimizer) -> None:
    """Mark ``wrapper.step`` the way torch's LR schedulers mark the step of the optimizer they are built on.

    A scheduler checks, at its first ``step()``, that its optimizer's step is marked and has run.
    Pointed at the wrapper, it warned that ``optimizer.step()`` had been overridden; left on the
    wrapped optimizer (built before ``fabric.setup``), it warned that it stepped before the
    optimizer, whose own step never runs. A step of the wrapper now counts for both. Both of
    torch's marks are set: ``_wrapped_by_lr_sched`` with ``_opt_called`` (torch 2.2 and later) and
    ``_with_counter`` with ``_step_count`` (2.1).
    """
    step = wrapper.step
    function = getattr(step, "__func__", None)
    if function is None or hasattr(step, "_wrapped_by_lr_sched") or hasattr(step, "_with_counter"):
        return  # marked already, or not a method this can rebind
    owners = [weakref.ref(wrapper)] + ([weakref.ref(wrapped)] if wrapped is not wrapper else [])
    wrapper._step_count = 0  # type: ignore[attr-defined]

    @functools.wraps(function)
    def marked_step(*args: Any, **kwargs: Any) -> Any:
        for owner in owners:  # weak references: no cycle through the instance attribute, as torch does it
            optimizer = owner()
            if optimizer is not None:
                optimizer._opt_called = True  # type: ignore[attr-defined]
                optimizer._step_count = getattr(optimizer, "_step_count", 0) + 1  # type: ignore[attr-defined]
        return function(owners[0](), *args, **kwargs)

    marked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    marked_step._with_counter = True  # type: ignore[attr-defined]
    wrapper.step = marked_step  # type: ignore[method-assign]


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
        with param_groups_kept([optimizer]):
            optimizer.load_state_dict(state)


@contextlib.contextmanager
def param_groups_kept(optimizers: Sequence[Optimizer]) -> Iterator[None]:
    """Let ``load_state_dict`` run inside, and keep each optimizer's param-group dicts, filled with what it loaded.

    Horovod's wrapper shares its param-group dicts with the optimizer it wrapped, and a learning-rate
    scheduler built on that optimizer before the wrap (``scheduler = StepLR(optimizer)``, then
    ``fabric.setup``) sets the rates in those dicts. ``load_state_dict`` puts new dicts in place, so
    on the ranks that loaded, the wrapper no longer saw the scheduler's rates and they trained
    with others.
    """
    kept = [(optimizer, list(optimizer.param_groups)) for optimizer in optimizers]
    yield
    for optimizer, groups in kept:
        if len(groups) != len(optimizer.param_groups):
            continue  # loading changed the groups themselves: nothing to keep
        for old, loaded in zip(groups, optimizer.param_groups, strict=True):
            if old is not loaded:
                old.clear()
                old.update(loaded)
        optimizer.param_groups = groups


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
