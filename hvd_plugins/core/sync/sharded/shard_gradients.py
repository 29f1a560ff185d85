"""Gradients a worker holds only a slice of, whose norms torch's own tools take over every worker.

Under ``shard="parameters"`` each parameter is, between its unit's computations, this worker's part of it, and
after the step's sync its ``.grad`` is that part of the averaged gradient (``ShardGradient``). Code written for
one process computes norms from them: ``torch.nn.utils.clip_grad_norm_``, or ``p.grad.norm()`` for logging. A
norm of a part is not the norm of the whole, so a norm taken of a ``ShardGradient`` is a ``PartialNorm``: this
worker's share, which becomes the norm over every worker (one collective) where it is first used as a number.
torch's clipping takes each gradient's norm, stacks them and takes the norm of the stack; that last norm sums
the shares' powers over every worker in one collective, and the scaling that follows runs on each worker's
part, in place, on the slices the optimizer steps. DTensor's ``Partial`` placement does the same with a
process group; here Horovod carries the sum.

Every worker takes the same norms in the same order (each conversion of a share is a collective), as it runs
the same training code.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from hvd_plugins.core.comm.world import max_over_world, sum_over_world


@dataclass
class ShardedNorms:
    """What a norm over the sharded gradients needs to know: how many workers hold each slice (one per node when
    sharded inside the node), and the trainable parameters whose averaged gradients live only in slices with no
    ``.grad`` to show for them (parameters kept whole under ``shard="parameters"``): a norm over the model's
    gradients that misses them is refused rather than returned wrong."""

    copies: int = 1
    hidden: list[str] = field(default_factory=list)
    _calls: Any = field(default_factory=itertools.count)

    def name(self) -> str:
        """A collective name of its own for each norm (every worker takes them in the same order)."""
        return f"shard.torch_norm.{next(self._calls)}"


NORM_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm, torch.functional.norm}
)
"""Functions that take a norm of a whole tensor (the gradients are 1-D, so any ``dim`` of theirs is all of it)."""

KEEP_PARTIAL: frozenset[Callable[..., Any]] = frozenset(
    {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.detach, torch.Tensor.clone,
     torch.Tensor.float, torch.Tensor.double}
)  # fmt: skip
"""Functions that move or copy a share without using its value: it stays a share."""


def norm_order(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> float:
    """The order of the norm ``func(*args, **kwargs)`` asks for (``p`` or ``ord``; 2 by default, as torch's)."""
    given = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p"))
    if given is None or given == "fro":
        return 2.0
    if isinstance(given, str):
        raise ValueError(
            f"a {given!r} norm of a gradient shard is not a vector norm: use fabric.clip_gradients(model, optimizer, "
            "max_norm=...) or the Trainer's gradient_clip_val, which clip by the norm over every worker"
        )
    return float(given)


class ShardGradient(torch.Tensor):
    """This worker's part of a parameter's averaged gradient (1-D, a view of the slice its optimizer steps). Any
    operation runs on the part as on a plain tensor, but a norm of it is a ``PartialNorm``."""

    norms: ShardedNorms

    @staticmethod
    def of(view: torch.Tensor, norms: ShardedNorms) -> ShardGradient:
        gradient = view.as_subclass(ShardGradient)
        gradient.norms = norms
        return gradient

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch._foreach_norm:
            return _foreach_shares(args, kwargs)
        if func in NORM_FUNCTIONS and args and isinstance(args[0], ShardGradient):
            order, shard = norm_order(func, args, kwargs), args[0]
            with DisableTorchFunctionSubclass():  # a worker may hold none of a parameter: its share is 0
                local = func(*args, **kwargs) if shard.numel() else shard.new_zeros(())
            return PartialNorm.of(local, order, shard.norms)
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _foreach_shares(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """``torch._foreach_norm`` over a list holding gradient shards: a share for each shard, a plain norm otherwise."""
    tensors = list(args[0])
    order = float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
    with DisableTorchFunctionSubclass():
        locals_ = [torch.linalg.vector_norm(t, order) if t.numel() else t.new_zeros(()) for t in tensors]
    return [
        PartialNorm.of(local, order, tensor.norms) if isinstance(tensor, ShardGradient) else local
        for tensor, local in zip(tensors, locals_, strict=True)
    ]


class PartialNorm(torch.Tensor):
    """This worker's share of norms of order ``order`` (its part's norm): a scalar, or a stack of scalars where
    ``shares`` marks the entries that are shares (the others are whole norms, of gradients every worker holds).
    Moved or stacked it stays a share; a norm of a stack of shares is the norm over every worker; anything else
    uses the whole norms, each made whole first."""

    order: float
    norms: ShardedNorms
    shares: torch.Tensor | None

    @staticmethod
    def of(local: torch.Tensor, order: float, norms: ShardedNorms, shares: torch.Tensor | None = None) -> PartialNorm:
        partial = local.as_subclass(PartialNorm)
        partial.order, partial.norms, partial.shares = order, norms, shares
        return partial

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in KEEP_PARTIAL and isinstance(first, PartialNorm):
            with DisableTorchFunctionSubclass():
                moved = func(*args, **kwargs)
            return PartialNorm.of(moved, first.order, first.norms, first.shares)
        if func is torch.stack and isinstance(first, (list, tuple)):
            return _stacked(first, args[1:], kwargs)
        if func in NORM_FUNCTIONS and isinstance(first, PartialNorm):
            if first.shares is not None and norm_order(func, args, kwargs) == first.order and not _keeps_dim(kwargs):
                return _total(first)
        resolved = [whole_norm(arg) if isinstance(arg, PartialNorm) else arg for arg in args]
        resolved_kwargs = {k: whole_norm(v) if isinstance(v, PartialNorm) else v for k, v in kwargs.items()}
        with DisableTorchFunctionSubclass():
            return func(*resolved, **resolved_kwargs)


def _keeps_dim(kwargs: dict[str, Any]) -> bool:
    return bool(kwargs.get("keepdim", False))


def _stacked(entries: Sequence[torch.Tensor], rest: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """``torch.stack`` of scalar norms, some of them shares: a stack that remembers which entries are shares."""
    partial = [entry for entry in entries if isinstance(entry, PartialNorm)]
    scalars = all(entry.dim() == 0 for entry in entries)
    orders = {entry.order for entry in partial}
    if not partial or not scalars or len(orders) != 1 or any(e.shares is not None for e in partial):
        resolved = [whole_norm(entry) if isinstance(entry, PartialNorm) else entry for entry in entries]
        with DisableTorchFunctionSubclass():
            return torch.stack(resolved, *rest, **kwargs)
    with DisableTorchFunctionSubclass():
        stack = torch.stack(list(entries), *rest, **kwargs)
    shares = torch.tensor([isinstance(entry, PartialNorm) for entry in entries], device=stack.device)
    return PartialNorm.of(stack, orders.pop(), partial[0].norms, shares)


def _total(stack: PartialNorm) -> torch.Tensor:
    """The norm of a stack of norms, some of them shares: the shares' powers summed over every worker (one
    collective), the whole norms' added once. Refused where the model hides gradients from the norm."""
    norms, order = stack.norms, stack.order
    if norms.hidden:
        shown = ", ".join(norms.hidden[:3]) + (", ..." if len(norms.hidden) > 3 else "")
        raise ValueError(
            f"shard='parameters': the averaged gradients of {shown} live only in this worker's slices (they are "
            "kept whole, outside every unit), so a norm over model.parameters() cannot include them. Clip with "
            "fabric.clip_gradients(model, optimizer, max_norm=...) or the Trainer's gradient_clip_val, which take "
            "the norm over every worker's slices, or put those parameters in a unit (a module whose forward runs)."
        )
    with DisableTorchFunctionSubclass():
        values = stack.detach().as_subclass(torch.Tensor).double().cpu()
        assert stack.shares is not None
        shares, whole = values[stack.shares.cpu()], values[~stack.shares.cpu()]
        local = torch.linalg.vector_norm(shares, order) if shares.numel() else values.new_zeros(())
        combined = over_workers(local.reshape(1), order, norms)  # one collective for every share
        total = torch.linalg.vector_norm(torch.cat([combined, whole]), order)
        return total.to(stack.device, stack.dtype)


def whole_norm(partial: PartialNorm) -> torch.Tensor:
    """A share made the norm over every worker (a collective), entry by entry for a stack."""
    with DisableTorchFunctionSubclass():
        values = partial.detach().as_subclass(torch.Tensor).double().cpu()
        shares = partial.shares.cpu() if partial.shares is not None else torch.ones_like(values, dtype=torch.bool)
        result = torch.where(shares, over_workers(values, partial.order, partial.norms), values)
        return result.to(partial.device, partial.dtype)


def over_workers(local: torch.Tensor, order: float, norms: ShardedNorms) -> torch.Tensor:
    """Norms of order ``order`` over every worker, entry by entry, from this worker's shares ``local`` (CPU): the
    largest share for the infinity norm, else the root of the summed powers (each slice held by ``norms.copies``
    workers counts once). A collective."""
    if math.isinf(order):
        return max_over_world(local.abs().reshape(-1), norms.name()).reshape(local.shape)
    summed = sum_over_world(local.abs().pow(order).reshape(-1), norms.name()) / norms.copies
    return summed.pow(1.0 / order).reshape(local.shape)
