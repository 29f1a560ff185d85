"""``sync="allreduce"``: Horovod's ``DistributedOptimizer``, one allreduce per gradient from backward hooks; and
``op="adasum"``, Horovod's Adasum optimizer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.optim import Optimizer

from hvd_plugins.core.backend.optimizer import (
    delay_next_allreduce,
    distributed_optimizer,
    drop_gradient_hooks,
    follow_trainable_parameters,
    set_backward_passes,
    skip_synchronize,
    started_allreduces,
    synchronize,
)
from hvd_plugins.core.backend.waits import wait_for_pending_allreduces
from hvd_plugins.core.comm.compression import Compressor, CountingCompressor
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.gradients import divide_gradients_
from hvd_plugins.core.comm.wire import horovod_op
from hvd_plugins.core.comm.world import world_size
from hvd_plugins.core.sync.base import GradientSync


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
        wrapped = distributed_optimizer(
            optimizer,
            named_parameters=named_parameters,
            compression=self.compressor,
            backward_passes_per_step=self.backward_passes,
            op=horovod_op(self.op),
            gradient_predivide_factor=self.gradient_predivide_factor,
            sparse_as_dense=self.sparse_as_dense,
        )
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
            divide_gradients_(optimizer, world_size())

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        for optimizer in optimizers:
            drop_gradient_hooks(optimizer)
        self._late_names.clear()  # the next fit (or the fit after an elastic reset) wraps and names anew


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
