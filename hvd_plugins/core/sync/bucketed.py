"""``sync="allreduce"`` by buckets: Horovod's ``DistributedOptimizer`` wraps the optimizer, one allreduce per bucket.

Horovod's own hooks start one allreduce per gradient, and its background thread negotiates every
one of them with every worker before it fuses them: on a model of many small tensors (a
Transformer's 260) that negotiation, not the bytes, set the step time, and the flat sync ran at
0.70-0.83x of torch's DDP on the same machine. Here the optimizer is still Horovod's
``DistributedOptimizer`` (its ``skip_synchronize``, ``step`` and options stay), but its hooks are held;
backward fills buckets of ``bucket_mb`` instead (``comm.reducer``, reverse order, as DDP does), and
each full bucket is one Horovod allreduce while backward goes on: a handful of negotiations a step.

What the buckets cannot carry goes through Horovod's hooks as before (``uses_buckets``): sparse
gradients (``nn.Embedding(sparse=True)``: Horovod allgathers them), ``gradient_predivide_factor``, and
Adasum. The sum is the same: Gloo's and NCCL's ring allreduce add the same workers' values, only in
fused buffers of another layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.backend.optimizer import forget_held_gradients, hold_gradient_hooks, set_backward_passes
from hvd_plugins.core.comm.compression import Compressor, NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.gradients import divide_gradients_
from hvd_plugins.core.comm.in_flight import InFlight, Then
from hvd_plugins.core.comm.reducer import BucketReducer, OptimizerReducers
from hvd_plugins.core.comm.two_level import OneLevelSum, write_total
from hvd_plugins.core.comm.world import world_group, world_size
from hvd_plugins.core.comm.world_sum import WorldSumInPlace
from hvd_plugins.core.sync.flat import HorovodOptimizerSync

SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def has_sparse_gradients(model: Module) -> bool:
    """Whether backward may give ``model`` sparse gradients (an embedding built with ``sparse=True``)."""
    return any(isinstance(module, SPARSE_MODULES) and module.sparse for module in model.modules())


def uses_buckets(op: str, gradient_predivide_factor: float, sparse_as_dense: bool) -> bool:
    """Whether ``sync="allreduce"`` with these options sums buckets (else Horovod's per-gradient hooks do).

    Adasum combines updates, not gradients; a predivide factor and ``sparse_as_dense`` are options of
    Horovod's hook path, which keeps them exactly as Horovod documents them.
    """
    return op in ("average", "sum") and gradient_predivide_factor == 1.0 and not sparse_as_dense


class BucketedAllreduceSync(HorovodOptimizerSync):
    """Horovod's ``DistributedOptimizer`` with its hooks held, and one Horovod allreduce per full gradient bucket.

    A model with sparse gradients (found at ``setup``) keeps Horovod's hooks: everything then runs as in
    ``HorovodOptimizerSync``.
    """

    world_shaped = True  # the buckets' sums are named and sized for the world they started in

    def __init__(
        self, compressor: Compressor, op: str, counters: CommCounters, scope: Scope, bucket_bytes: int
    ) -> None:
        super().__init__(compressor, op, counters, scope)
        self.codec = compressor  # OneLevelSum counts the bytes itself
        self.scope = scope
        self.bucket_bytes = bucket_bytes
        self.bucketed = True
        """False once ``setup`` found sparse gradients: Horovod's own hooks average every gradient."""
        self._names: dict[int, str] = {}  # by optimizer, in wrap order: equal on every rank
        self._reducers = OptimizerReducers(bucket_bytes, self._sum_bucket, alone=True, counters=counters)

    # ------------------------------------------------------------------ wrapping and arming
    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        wrapped = super().wrap(optimizer, named_parameters)
        self._names[id(wrapped)] = f"grad.opt{len(self._names)}"
        self._arm(wrapped)
        return wrapped

    def setup(self, model: Module, optimizers: Sequence[Optimizer], total_epochs: int | None) -> None:
        if self.bucketed and has_sparse_gradients(model):
            self.bucketed = False
            self._reducers.remove_all()
            for optimizer in optimizers:
                set_backward_passes(optimizer, self.backward_passes)  # Horovod's hooks count down again

    def _arm(self, optimizer: Optimizer) -> None:
        """Hold Horovod's hooks and let backward start the buckets (built again if the trainable parameters changed)."""
        if not self.bucketed:
            return
        hold_gradient_hooks(optimizer)
        self._reducer_for(optimizer).armed = world_size() > 1

    def _reducer_for(self, optimizer: Optimizer) -> BucketReducer:
        return self._reducers.for_optimizer(optimizer, self._names[id(optimizer)], self.backward_passes)

    def _sum_bucket(self, index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
        """Start one bucket's allreduce over every worker; it lands, averaged or summed, in ``flat``."""
        size = world_size()
        if size == 1:
            return None
        divide_by = size if self.op == "average" else None
        if isinstance(self.codec, NoCompression):  # the bucket is sent as it is: summed where it lies
            return WorldSumInPlace(flat, f"{name}.ar", self.counters, self.scope, divide_by)
        pending = OneLevelSum(flat, world_group(), self.codec, self.counters, self.scope, f"{name}.ar")

        def written(total: torch.Tensor) -> torch.Tensor:
            write_total(flat, total, divide_by)
            return flat

        return Then(pending, written)

    # ------------------------------------------------------------------ the step
    def synchronize(self, optimizer: Optimizer) -> None:
        if not self.bucketed:
            super().synchronize(optimizer)
            return
        forget_held_gradients(optimizer)
        reducer = self._reducer_for(optimizer)
        reducer.finish()
        self._reducers.reduce_late(optimizer, reducer)
        self._arm(optimizer)

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        if not self.bucketed:
            super().set_backward_passes(optimizer, passes)
            return
        self.backward_passes = passes
        set_backward_passes(optimizer, passes)  # Horovod's countdowns, held again by _arm
        if (reducer := self._reducers.existing(optimizer)) is not None:
            reducer.set_backward_passes(passes)
        self._arm(optimizer)

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        if not self.bucketed:
            super().hold_next_backward(optimizer)
        elif (reducer := self._reducers.existing(optimizer)) is not None:
            reducer.hold_next_backward()

    def before_backward(self, optimizer: Optimizer) -> None:
        """A second backward before the step: finish the buckets the first one started, as the hook path does.

        The gradients become their average, this backward adds its own, and the step averages again:
        the average over workers of the gradients summed over the passes, as under DDP (``op="sum"``:
        the settled sum is divided by the workers first).
        """
        if not self.bucketed:
            super().before_backward(optimizer)
            return
        reducer = self._reducers.existing(optimizer)
        if reducer is not None and reducer.in_flight:
            self.synchronize(optimizer)
            if self.op == "sum":
                divide_gradients_(optimizer, world_size())
        elif id(optimizer) in self._names:
            self._arm(optimizer)  # buckets built again if the trainable parameters changed

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        super().teardown(optimizers)
        self._reducers.remove_all()
        self._names.clear()
