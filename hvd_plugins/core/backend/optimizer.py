"""The private attributes of Horovod's ``DistributedOptimizer`` that training has to touch; nowhere else knows them.

A future Horovod release should need changes here (and in the other ``backend`` modules) only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch

from hvd_plugins.core.backend.module import horovod_torch

HorovodOptimizer = Any
"""A torch optimizer, usually a Horovod ``DistributedOptimizer`` (whose class Horovod builds, untyped); the
functions here leave any other optimizer alone."""


def set_backward_passes(optimizer: HorovodOptimizer, passes: int) -> None:
    """Change how many backward passes a DistributedOptimizer accumulates before it allreduces.

    Safe between steps only: no allreduce is pending, so the per-parameter countdowns can restart
    (Horovod's public ``set_backward_passes_per_step`` restarts them).
    """
    if hasattr(optimizer, "set_backward_passes_per_step"):
        optimizer.set_backward_passes_per_step(passes)


def delay_next_allreduce(optimizer: HorovodOptimizer) -> None:
    """Let the next backward only add to the gradients: every parameter's countdown to its allreduce gains one.

    The step's ``synchronize`` (or the countdown of a later backward) still averages the sum, and each
    step resets the countdowns to ``backward_passes_per_step``.
    """
    for parameter in getattr(optimizer, "_allreduce_delay", {}):
        optimizer._allreduce_delay[parameter] += 1


def started_allreduces(optimizer: HorovodOptimizer) -> bool:
    """Whether a backward since the last ``synchronize`` had its hooks start allreduces (not held ones)."""
    return any(handle is not None for handle, _ in getattr(optimizer, "_handles", {}).values())


HELD_COUNTDOWN = 2**30
"""A countdown no run of backward passes reaches: the hooks only count, nothing starts."""


def hold_gradient_hooks(optimizer: HorovodOptimizer) -> None:
    """Keep a DistributedOptimizer's backward hooks from starting allreduces until ``set_backward_passes``.

    For steps whose gradients another route averages after backward; safe between steps only.
    """
    for parameter in getattr(optimizer, "_allreduce_delay", {}):
        optimizer._allreduce_delay[parameter] = HELD_COUNTDOWN


def forget_held_gradients(optimizer: HorovodOptimizer) -> None:
    """Drop the entries held hooks left (no allreduce started), so Horovod's ``synchronize`` sends nothing for them.

    Call once the gradients were averaged another way, before ``set_backward_passes`` or the next hold.
    """
    handles = getattr(optimizer, "_handles", {})
    started = [key for key, (handle, _) in handles.items() if handle is not None]
    if started:
        raise RuntimeError(f"{len(started)} allreduces were started by hooks that were held; cannot drop them")
    handles.clear()


def synchronize(optimizer: HorovodOptimizer) -> None:
    """Horovod's ``synchronize``: complete the step's allreduces (starting those no hook started)."""
    optimizer.synchronize()


def skip_synchronize(optimizer: HorovodOptimizer) -> AbstractContextManager[None]:
    """Horovod's ``skip_synchronize``: the next ``step`` does not synchronize by itself."""
    context: AbstractContextManager[None] = optimizer.skip_synchronize()
    return context


def forget_failed_allreduces(optimizer: HorovodOptimizer) -> None:
    """After an elastic reset: drop the handles of allreduces the old Horovod started (they will never complete)
    and start each parameter's countdown again, so the next backward starts its allreduces as usual."""
    getattr(optimizer, "_handles", {}).clear()
    set_backward_passes(optimizer, getattr(optimizer, "backward_passes_per_step", 1))


_SHARED_CLASSES: dict[tuple[type, Any], type] = {}
"""One DistributedOptimizer class per (wrapped optimizer class, Horovod flavour), see ``share_class``."""


def distributed_optimizer(optimizer: torch.optim.Optimizer, **options: Any) -> HorovodOptimizer:
    """Horovod's ``DistributedOptimizer`` around ``optimizer`` (``options`` are its own), of the class every
    wrap of this optimizer class shares (``share_class``)."""
    wrapped = horovod_torch().DistributedOptimizer(optimizer, **options)
    share_class(wrapped)
    return wrapped


def share_class(optimizer: HorovodOptimizer) -> None:
    """Give every DistributedOptimizer that wraps one optimizer class the same class object.

    Horovod builds a new class for every optimizer it wraps (same name, same methods), so code that
    tells optimizers apart by their class took two wrapped SGDs for two kinds: Lightning's
    ``LearningRateMonitor`` numbers ``lr-SGD``, ``lr-SGD-1`` by class, and logged both learning
    rates under ``lr-SGD``, one overwriting the other. The classes Horovod builds for one optimizer
    class are alike (its ``_DistributedOptimizer`` or Adasum methods on that base), so the first
    one serves them all.
    """
    horovod_class = type(optimizer)
    if not hasattr(optimizer, "_requires_update") or len(horovod_class.__bases__) != 1:
        return  # not a DistributedOptimizer
    flavour = horovod_class.__dict__.get("synchronize")  # the same function in every class of one flavour
    optimizer.__class__ = _SHARED_CLASSES.setdefault((horovod_class.__bases__[0], flavour), horovod_class)


def make_zero_grad_wrapper_safe(optimizer: HorovodOptimizer, unwrap: Callable[[Any], Any]) -> None:
    """Give a DistributedOptimizer's class a ``zero_grad`` that also works through a subclassing wrapper.

    Horovod's ``zero_grad`` calls ``super(self.__class__, self)``: through Fabric's optimizer wrapper
    (a subclass of the optimizer's class) that recurses forever. Each DistributedOptimizer has a class
    of its own, so this changes nothing else. Allreduces a backward started are completed first (see
    ``_zero_grad_completing_allreduces``). ``unwrap(obj)`` is the DistributedOptimizer a wrapper
    stands for (``obj`` itself when it is none); the face that knows the wrapper gives it.
    """
    if not hasattr(optimizer, "_handles"):
        return
    horovod_class = type(optimizer)

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        target = unwrap(self)  # the DistributedOptimizer itself
        if target._handles:
            target.synchronize()
        super(horovod_class, target).zero_grad(set_to_none=set_to_none)

    horovod_class.zero_grad = zero_grad


def follow_trainable_parameters(optimizer: HorovodOptimizer, name_prefix: str) -> None:
    """Have a DistributedOptimizer average parameters that became trainable after it was built.

    Horovod hooks and averages only the parameters that required gradients when it wrapped the
    optimizer, so a layer unfrozen later (Lightning's ``BaseFinetuning``, a param group added
    while training) would train on each worker's own gradients and the workers would drift
    apart. Each such parameter gets what Horovod gives its own: a name (``name_prefix`` and its
    place in the param groups, equal on every rank), a countdown and a backward hook. Called
    before ``synchronize``, which then averages it this step too (Horovod allreduces every
    tracked parameter whose hook did not fire). Horovod's Adasum optimizer steps each parameter
    inside its hook, from a starting copy it keeps per parameter, so a parameter it did not hook
    would never step at all: it gets that copy too, and Adasum's ``step`` combines it this step.
    """
    tracked = getattr(optimizer, "_requires_update", None)
    if tracked is None or horovod_torch().size() == 1:
        return  # not a DistributedOptimizer, or a single worker (Horovod hooks nothing then)
    for group_index, group in enumerate(optimizer.param_groups):
        for position, parameter in enumerate(group["params"]):
            if not parameter.requires_grad or parameter in tracked:
                continue
            optimizer._parameter_names.setdefault(parameter, f"{name_prefix}.group{group_index}.param{position}")
            optimizer._allreduce_delay[parameter] = optimizer.backward_passes_per_step
            starting_copies = getattr(optimizer, "_starting_models", None)  # Adasum's only
            if starting_copies is not None:
                starting_copies.setdefault(parameter, torch.zeros_like(parameter, requires_grad=False))
            tracked.add(parameter)
            with torch.enable_grad():
                accumulator = parameter.expand_as(parameter).grad_fn.next_functions[0][0]
            accumulator.register_hook(optimizer._make_hook(parameter))
            optimizer._grad_accs.append(accumulator)


def drop_gradient_hooks(optimizer: HorovodOptimizer) -> None:
    """Forget a DistributedOptimizer's gradient hooks, so a later fit in this process starts clean."""
    getattr(optimizer, "_grad_accs", []).clear()


def pin_zero_grad(lightning_optimizers: Iterable[Any]) -> None:
    """Give each LightningOptimizer a ``zero_grad`` that works as it does under DDP.

    Horovod's own ``zero_grad`` calls ``super(self.__class__, self)``, which recurses forever on a
    LightningOptimizer (it subclasses the wrapped class), so each gets a function bound to the
    optimizer it wraps instead.
    """
    for lightning_optimizer in lightning_optimizers:
        lightning_optimizer.zero_grad = _zero_grad_completing_allreduces(lightning_optimizer.optimizer)


def _zero_grad_completing_allreduces(optimizer: HorovodOptimizer) -> Callable[..., None]:
    """``zero_grad`` that first completes allreduces a backward started for this optimizer.

    In a GAN step written the DDP way (no ``toggle_optimizer``), the generator's backward also
    produces discriminator gradients, whose hooks start allreduces; Horovod's ``zero_grad`` then
    refuses to run. Every rank ran the same backward, so every rank waits for the same
    allreduces here, and the gradients are then dropped, as DDP drops them.
    """
    if not hasattr(optimizer, "_handles"):  # not a DistributedOptimizer (node-aware syncs wrap nothing)
        return optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        if optimizer._handles:
            optimizer.synchronize()
        super(type(optimizer), optimizer).zero_grad(set_to_none=set_to_none)

    return zero_grad
