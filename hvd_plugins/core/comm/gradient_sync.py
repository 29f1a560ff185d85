"""How gradients are averaged before the optimizer steps: the interface every sync mode offers, flat and two-level.

Lightning calls ``optimizer.step(closure)`` and the closure runs backward, so gradients may
only be averaged after the closure ran. The strategy therefore keeps the optimizer from
synchronizing on its own (``deferred``) and calls ``synchronize`` right after backward,
before gradient clipping and the AMP unscale see the gradients.

A sync mode owns its state (the hierarchical route, DASO's schedule) and offers the hooks a
training loop calls (``setup``, epoch and batch events, ``state_dict``/``load_state_dict``), so a
strategy wires any mode the same way and never asks which one it has.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.optimizer import (
    delay_next_allreduce,
    drop_gradient_hooks,
    follow_trainable_parameters,
    set_backward_passes,
    share_class,
    skip_synchronize,
    started_allreduces,
    synchronize,
)
from hvd_plugins.core.backend.waits import wait_for_pending_allreduces
from hvd_plugins.core.comm.compression import Compressor, CountingCompressor
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.parameters import optimizer_parameters
from hvd_plugins.core.comm.topology import Topology
from hvd_plugins.core.comm.wire import horovod_op


class TrainingLoopHooks:
    """What a sync mode may do at the training loop's events; each hook does nothing unless overridden."""

    def setup(self, model: Module, optimizers: Sequence[Optimizer], total_epochs: int | None) -> None:
        """Once the wrapped optimizers exist and every worker holds the same parameters."""

    def on_train_epoch_start(self) -> None:
        """At every training epoch's start, after callbacks that (un)freeze parameters."""

    def on_train_batch_start(self) -> None:
        """Before every training batch."""

    def after_optimizer_step(self, last_batch_of_epoch: bool) -> None:
        """After every batch that stepped the optimizers."""

    def on_train_epoch_end(self, epoch_loss: Callable[[], float | None]) -> None:
        """After the epoch's last batch, on every worker; ``epoch_loss()`` is a collective (the all-worker mean)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this sync (empty: nothing)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what ``state_dict`` returned; may come before ``setup``."""

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        """After a fit: forget its optimizers, so a later fit in this process starts clean (state is kept)."""

    def refuse_unsupported(self, accumulate_grad_batches: int, clips_gradients: bool) -> None:
        """Before the first step: raise, naming the setting, for training this sync cannot do."""


class GradientSync(TrainingLoopHooks, ABC):
    """Averages the gradients of one optimizer's parameters across workers, and follows the training loop.

    The loop hooks do nothing here; a mode that keeps state across steps or epochs overrides them.
    """

    backward_passes: int = 1  # micro-batches accumulated into one optimizer step
    topology: Topology | None = None  # the node layout, for the node-aware modes
    world_shaped: bool = False
    """Whether the mode holds a layout of the world (node groups, shards): an elastic reset then builds
    it again from the config, keeping its ``state_dict``; otherwise it follows the new world in place."""

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        """Return the optimizer the Trainer should use (possibly a wrapper)."""
        return optimizer

    @contextlib.contextmanager
    def deferred(self, optimizer: Optimizer) -> Iterator[None]:
        """Keep ``optimizer.step`` from synchronizing by itself."""
        yield

    @abstractmethod
    def synchronize(self, optimizer: Optimizer) -> None:
        """Average the gradients now; called once per optimizer step, after backward."""

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        """Tell the sync how many backward passes accumulate into one step."""
        self.backward_passes = passes

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        """The next backward only adds to the gradients (a loop's ``no_backward_sync``); explicit syncs wait anyway."""

    def before_backward(self, optimizer: Optimizer) -> None:
        """Before every backward: settle what an earlier backward of this step started, if anything."""


class HorovodOptimizerSync(GradientSync):
    """Horovod's ``DistributedOptimizer``: one allreduce per gradient, started by backward hooks.

    Accumulation uses ``backward_passes_per_step`` so an allreduce runs once per optimizer
    step, not once per micro-batch.
    """

    def __init__(
        self,
        compressor: Compressor,
        op: str,
        counters: CommCounters,
        scope: Scope,
        gradient_predivide_factor: float = 1.0,
        sparse_as_dense: bool = False,
    ) -> None:
        self.compressor = CountingCompressor(compressor, counters, scope)
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.counters = counters
        self.gradient_predivide_factor = gradient_predivide_factor
        self._late_names: dict[int, str] = {}
        """Name prefix, per wrapped optimizer, for parameters that become trainable after the wrap."""

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        wrapped = horovod_torch().DistributedOptimizer(
            optimizer,
            named_parameters=named_parameters,
            compression=self.compressor,
            backward_passes_per_step=self.backward_passes,
            op=horovod_op(self.op),
            gradient_predivide_factor=self.gradient_predivide_factor,
            sparse_as_dense=self.sparse_as_dense,
        )
        share_class(wrapped)
        self._late_names[id(wrapped)] = f"late{len(self._late_names)}"  # wrap order: equal on every rank
        return wrapped

    @contextlib.contextmanager
    def deferred(self, optimizer: Optimizer) -> Iterator[None]:
        with skip_synchronize(optimizer):
            yield

    def synchronize(self, optimizer: Optimizer) -> None:
        self.follow_trainable(optimizer)
        with self.counters.waiting():
            wait_for_pending_allreduces(optimizer)
            synchronize(optimizer)

    def follow_trainable(self, optimizer: Optimizer) -> None:
        """Let Horovod's optimizer take in parameters that became trainable since it wrapped them."""
        follow_trainable_parameters(optimizer, self._late_names.get(id(optimizer), "late"))

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        self.backward_passes = passes
        set_backward_passes(optimizer, passes)

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        delay_next_allreduce(optimizer)

    def before_backward(self, optimizer: Optimizer) -> None:
        """A second backward before the step (accumulating without ``no_backward_sync``, as DDP allows).

        Horovod's hooks refuse to fire twice in one step, so the allreduces the earlier backward
        started are completed here: the gradients become their average, the countdowns restart,
        and this backward adds its own, which the step averages again. The average of what every
        worker holds alike is itself, so the step sees the average over workers of the gradients
        summed over the backward passes, as under DDP. With ``op="sum"`` the settled sum is divided
        by the number of workers first, as the step sums it over every worker once more.
        """
        if not started_allreduces(optimizer):
            return
        self.synchronize(optimizer)
        if self.op == "sum":
            divide_gradients_(optimizer, horovod_torch().size())

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        for optimizer in optimizers:
            drop_gradient_hooks(optimizer)


class AdasumOptimizerSync(HorovodOptimizerSync):
    """Horovod's Adasum optimizer (``op="adasum"``, MPI controller): it combines updates, not gradients.

    Each parameter's backward hook runs the wrapped optimizer's step for that parameter locally and
    starts an Adasum allreduce of the resulting change; ``step()`` waits and applies the combined
    change. So there is nothing to synchronize after backward, and Horovod refuses to defer it
    (``skip_synchronize``). Gradients are never averaged: clipping them after backward would change
    nothing, and accumulation would step inside the hooks of a micro-batch, so both are refused.
    """

    @contextlib.contextmanager
    def deferred(self, optimizer: Optimizer) -> Iterator[None]:
        yield

    def synchronize(self, optimizer: Optimizer) -> None:
        self.follow_trainable(optimizer)  # before step(), which combines what no hook started yet
        with self.counters.waiting():
            wait_for_pending_allreduces(optimizer)  # the changes the hooks started; step() applies them

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        self.refuse_unsupported(passes, clips_gradients=False)  # an accumulation schedule changed it

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        raise ValueError(
            "op='adasum' cannot accumulate gradients (no_backward_sync): Horovod's Adasum optimizer steps inside "
            "the backward hooks. Step after every backward, or use op='average'."
        )

    def before_backward(self, optimizer: Optimizer) -> None:
        if started_allreduces(optimizer):
            raise ValueError(
                "op='adasum' cannot accumulate gradients (a second backward before the optimizer step): Horovod's "
                "Adasum optimizer steps inside the backward hooks. Step after every backward, or use op='average'."
            )

    def refuse_unsupported(self, accumulate_grad_batches: int, clips_gradients: bool) -> None:
        if accumulate_grad_batches > 1:
            raise ValueError(
                f"op='adasum' cannot accumulate gradients (accumulate_grad_batches={accumulate_grad_batches}): "
                "Horovod's Adasum optimizer steps inside the backward hooks. Use accumulate_grad_batches=1, "
                "or op='average'."
            )
        if clips_gradients:
            raise ValueError(
                "op='adasum' cannot clip gradients (gradient_clip_val is set): Horovod's Adasum optimizer has "
                "stepped by the time Lightning clips. Drop gradient_clip_val, or use op='average'."
            )


def divide_gradients_(optimizer: Optimizer, divisor: int) -> None:
    """Divide the gradients of ``optimizer``'s trainable parameters in place: a settled ``op="sum"`` sum that the
    step sums over every worker once more (see ``HorovodOptimizerSync.before_backward``)."""
    for parameter in optimizer_parameters(optimizer, trainable_only=True):
        if parameter.grad is not None:
            parameter.grad.div_(divisor)


def gradients_of(optimizer: Optimizer) -> Sequence[torch.Tensor]:
    """Gradients of every trainable parameter, zero-filled where none was produced, dense (``gradient_to_send``)."""
    return [gradient_to_send(parameter) for parameter in optimizer_parameters(optimizer, trainable_only=True)]


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
