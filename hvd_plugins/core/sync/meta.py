"""A model built on the meta device (``init_module(empty_init=True)``, or ``configure_model`` with
``shard="parameters"``) made real module by module, so that no worker need ever hold it whole.

A module with tensors of its own on the meta device gets real, uninitialized ones on the device and
then its ``reset_parameters()``, in module order, which is the order a model built whole runs its
initializers: from the same seed, the values are those of the model built whole. Each Parameter stays
the same object (``torch.utils.swap_tensors``), so optimizers built over the meta model still hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn import Module, Parameter

PLACEHOLDER_SHAPE = "_hvd_plugins_placeholder_shape"
"""The attribute a unit's Parameter left as a placeholder (``leave_placeholder``) keeps its shape in."""


def has_meta_tensors(module: Module, recurse: bool = True) -> bool:
    """Whether ``module`` (and, with ``recurse``, what is under it) holds a parameter or buffer on the meta device."""
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return any(tensor.is_meta for tensor in tensors)


def check_materializable(model: Module) -> None:
    """Refuse, before any is made real, a model with meta tensors in a module that cannot initialize them."""
    for name, module in model.named_modules():
        if has_meta_tensors(module, recurse=False) and initializer(module) is None:
            tensors = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
            own = [key for key, tensor in tensors if tensor.is_meta]
            raise ValueError(
                "the model holds tensors on the meta device (built there, or left so by an elastic reset), and module "
                f"{name or '(the model)'!r} "
                f"({type(module).__name__}) holds {own} but has no reset_parameters() to initialize them: give "
                f"{type(module).__name__} a reset_parameters() that fills them, or build the model without "
                "empty_init (Trainer.init_module(empty_init=False), or `with torch.device('cpu'):` in configure_model)"
            )


def materialize(
    model: Module,
    device: torch.device,
    units: Sequence[Module] = (),
    finished: Callable[[int], None] | None = None,
) -> None:
    """Every meta tensor of ``model`` made real on ``device`` and initialized, module by module in module order;
    ``finished(i)`` runs as soon as everything under ``units[i]`` is real (inner units before the outer)."""
    check_materializable(model)
    unit_index = {id(module): index for index, module in enumerate(units)}
    seen: set[int] = set()

    def visit(module: Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if has_meta_tensors(module, recurse=False):
            make_real(module, device)
            reset = initializer(module)
            assert reset is not None  # check_materializable
            reset()
        for child in module.children():
            visit(child)
        if finished is not None and id(module) in unit_index:
            finished(unit_index[id(module)])

    visit(model)


def initializer(module: Module) -> Callable[[], Any] | None:
    """How ``module`` fills its own parameters: ``reset_parameters()``, or torch's private ``_reset_parameters()``
    where a layer has only that (``nn.MultiheadAttention``, whose ``in_proj_weight`` is its own)."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def make_real(module: Module, device: torch.device) -> None:
    """``module``'s own meta tensors replaced by uninitialized ones on ``device``, each Parameter the same object."""
    with torch.no_grad():
        for parameter in module.parameters(recurse=False):
            if parameter.is_meta:
                make_parameter_real(parameter, device)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def real_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors that hold values: neither on the meta device nor freed (a sharded unit's parameters between uses)."""
    return [tensor for tensor in tensors if not tensor.is_meta and tensor.numel() > 0]


def make_parameter_real(parameter: Parameter, device: torch.device) -> None:
    """``parameter`` (on the meta device) given uninitialized memory on ``device``; the same object afterwards."""
    replace_values(parameter, torch.empty(parameter.shape, dtype=parameter.dtype, device=device))


def replace_values(parameter: Parameter, values: torch.Tensor) -> None:
    """``parameter`` made to hold ``values`` (another device, the meta device), staying the same Python object with
    its attributes: optimizers, hooks and the model still hold it. ``.data =`` cannot cross to or from meta."""
    new = Parameter(values, requires_grad=parameter.requires_grad)
    new.__dict__.update(parameter.__dict__)  # swap_tensors swaps the attributes too: keep the user's
    hooks = parameter._post_accumulate_grad_hooks
    torch.utils.swap_tensors(parameter, new)
    if hooks is not None:  # they stay registered on the old tensor: bind them to the new one, or they never run
        parameter._post_accumulate_grad_hooks = hooks


def leave_placeholder(parameter: Parameter, shape: torch.Size, dtype: torch.dtype | None = None) -> None:
    """``parameter`` an empty tensor that remembers ``shape``: a unit's parameter whose slices went with an old world
    (an elastic reset). ``placeholders_to_meta`` turns it into a meta tensor of that shape, made real as a model
    built on the meta device is, and a commit's slices give it its values. ``dtype``: its slices' (a unit gathered
    in bfloat16 to compute keeps float32 masters), else its own."""
    parameter.data = torch.empty(0, dtype=dtype or parameter.dtype, device=parameter.device)
    setattr(parameter, PLACEHOLDER_SHAPE, torch.Size(shape))


def placeholders_to_meta(model: Module) -> bool:
    """Every placeholder of ``model`` a meta tensor of its shape again; returns whether there was one."""
    found = False
    for parameter in model.parameters():
        shape = parameter.__dict__.pop(PLACEHOLDER_SHAPE, None)
        if shape is not None and parameter.numel() == 0:
            replace_values(parameter, torch.empty(shape, dtype=parameter.dtype, device="meta"))
            found = True
    return found
