"""How gradients are averaged before the optimizer steps.

Lightning calls ``optimizer.step(closure)`` and the closure runs backward, so gradients may
only be averaged after the closure ran. The strategy therefore keeps the optimizer from
synchronizing on its own (``deferred``) and calls ``synchronize`` right after backward,
before gradient clipping and the AMP unscale see the gradients.
"""

from __future__ import annotations

import contextlib
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch.optim import Optimizer

from hvd_plugins._horovod import horovod_torch
from hvd_plugins.comm.buckets import bucket_tensors, flatten, unflatten_into
from hvd_plugins.comm.compression import Compressor, CountingCompressor, compressor_by_name
from hvd_plugins.comm.counters import CommCounters, Scope
from hvd_plugins.comm.hierarchical import hierarchical_allreduce_
from hvd_plugins.comm.parameters import optimizer_parameters
from hvd_plugins.comm.partners import group_sum
from hvd_plugins.comm.route_tuning import FLAT, RouteTuner
from hvd_plugins.comm.topology import NodeGroups
from hvd_plugins.comm.wire import horovod_op, nbytes
from hvd_plugins.horovod_adapter import set_backward_passes, wait_for_pending_allreduces

if TYPE_CHECKING:
    from hvd_plugins.config import HorovodConfig


class GradientSync(ABC):
    """Averages the gradients of one optimizer's parameters across workers."""

    backward_passes: int = 1  # micro-batches accumulated into one optimizer step

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
    ) -> None:
        self.compressor = CountingCompressor(compressor, counters, scope)
        self.op = op
        self.counters = counters
        self.gradient_predivide_factor = gradient_predivide_factor

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        return horovod_torch().DistributedOptimizer(
            optimizer,
            named_parameters=named_parameters,
            compression=self.compressor,
            backward_passes_per_step=self.backward_passes,
            op=horovod_op(self.op),
            gradient_predivide_factor=self.gradient_predivide_factor,
        )

    @contextlib.contextmanager
    def deferred(self, optimizer: Optimizer) -> Iterator[None]:
        with optimizer.skip_synchronize():
            yield

    def synchronize(self, optimizer: Optimizer) -> None:
        with self.counters.waiting():
            wait_for_pending_allreduces(optimizer)
            optimizer.synchronize()

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        self.backward_passes = passes
        set_backward_passes(optimizer, passes)


class HierarchicalGradientSync(GradientSync):
    """Two-level allreduce of bucketed gradients after backward (see ``comm.hierarchical``).

    Buckets under ``flat_below_bytes`` take one flat allreduce instead of the three legs. With
    ``tune_route`` the larger ones try both routes on the first steps and keep the faster
    (``comm.route_tuning``); the choice is printed once by rank 0 and kept in ``route_tuner``.
    """

    def __init__(
        self,
        groups: NodeGroups,
        compressor: Compressor,
        op: str,
        counters: CommCounters,
        compress_node_local: bool = False,
        bucket_bytes: int = 32 * 2**20,
        flat_below_bytes: int = 0,
        tune_route: bool = False,
    ) -> None:
        if op not in ("average", "sum"):
            raise ValueError(f"op={op!r} is not supported with sync='hierarchical'; choose 'average' or 'sum'")
        self.tune_route = tune_route
        self.route_tuner: RouteTuner | None = None
        self.groups = groups
        self.compressor = compressor
        self.average = op == "average"
        self.counters = counters
        self.compress_node_local = compress_node_local
        self.bucket_bytes = bucket_bytes
        self.flat_below_bytes = flat_below_bytes
        self._names: dict[int, str] = {}  # by optimizer, in wrap order: equal on every rank

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        self._names[id(optimizer)] = f"grad.opt{len(self._names)}"
        return optimizer

    def synchronize(self, optimizer: Optimizer) -> None:
        grads = _gradients_of(optimizer)
        buckets = bucket_tensors(grads, self.bucket_bytes)
        flats = [flatten(bucket) for bucket in buckets]
        tuner = self._tuner_for(flats)
        began = time.perf_counter()
        hierarchical_allreduce_(
            flats,
            self.groups,
            average=self.average,
            compression=self.compressor,
            compress_node_local=self.compress_node_local,
            counters=self.counters,
            name=self._names[id(optimizer)],
            flat_below_bytes=sys.maxsize if tuner is not None and tuner.route == FLAT else self.flat_below_bytes,
        )
        if tuner is not None and tuner.choice is None:
            tuner.record(time.perf_counter() - began)
            if tuner.choice is not None and self.groups.topology.rank == 0:
                kept = "the flat allreduce" if tuner.choice == FLAT else "the two-level legs"
                print(
                    f"hvd_plugins: sync='hierarchical': gradient sync took {tuner.measured()}; large buckets now "
                    f"take {kept}. Pass flat_below_mb=<MiB> to fix the route instead.",
                    flush=True,
                )
        for flat, bucket in zip(flats, buckets, strict=True):
            unflatten_into(flat, bucket)

    def _tuner_for(self, flats: Sequence[torch.Tensor]) -> RouteTuner | None:
        """The tuner when there is a choice to make: two-level legs exist and some bucket would take them.

        Bucket sizes and the layout are equal on every worker, so every worker decides alike.
        """
        groups = self.groups
        if not self.tune_route or groups.local is None or groups.cross is None:
            return None
        if not any(nbytes(flat) >= self.flat_below_bytes for flat in flats):
            return None
        if self.route_tuner is None:
            hvd = horovod_torch()
            self.route_tuner = RouteTuner(lambda t: hvd.allreduce(t, op=hvd.Average, name="hvd_plugins.route"))
        return self.route_tuner


def _gradients_of(optimizer: Optimizer) -> Sequence[torch.Tensor]:
    """Gradients of every trainable parameter, zero-filled where backward produced none.

    Every worker must hand the same tensors to the collective, even when a parameter got no
    gradient on this worker (e.g. an unused branch).
    """
    grads = []
    for parameter in optimizer_parameters(optimizer, trainable_only=True):
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        grads.append(parameter.grad)
    return grads


class DasoGradientSync(GradientSync):
    """DASO's gradient average: over ALL workers in warmup and cooldown, inside the node while cycling.

    After backward, the gradients (zero-filled where backward produced none, so every worker
    sends the same tensors and every parameter gets optimizer state) are bucketed and flattened;
    every bucket is launched before any is awaited, so Horovod fuses them into one round per
    step. Over all workers they travel as ``global_wire`` ('fp16', or exact 'fp32'); inside the
    node with the strategy's compression. ``over_all_workers`` says which scope the current step
    uses; DASO's syncer sets it (``follow``), and until then every step averages over all workers.
    """

    def __init__(
        self,
        groups: NodeGroups,
        node_compressor: Compressor,
        global_wire: str,
        op: str,
        counters: CommCounters,
        bucket_bytes: int = 32 * 2**20,
    ) -> None:
        if op not in ("average", "sum"):
            raise ValueError(f"op={op!r} is not supported with sync='daso'; choose 'average' or 'sum'")
        self.groups = groups
        self.node_compressor = node_compressor
        self.global_compressor = compressor_by_name("fp16" if global_wire == "fp16" else "none")
        self.op = op
        self.counters = counters
        self.bucket_bytes = bucket_bytes
        self.over_all_workers: Callable[[], bool] = lambda: True
        self._names: dict[int, str] = {}  # by optimizer, in wrap order: equal on every rank

    def follow(self, over_all_workers: Callable[[], bool]) -> None:
        """Ask ``over_all_workers()`` before every average which scope applies to the step."""
        self.over_all_workers = over_all_workers

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        self._names[id(optimizer)] = f"daso.grad.opt{len(self._names)}"
        return optimizer

    def synchronize(self, optimizer: Optimizer) -> None:
        grads = _gradients_of(optimizer)
        everywhere = self.over_all_workers()
        if not grads or horovod_torch().size() == 1 or (self.groups.local is None and not everywhere):
            return  # alone in its group: nothing to average (the gradients are zero-filled all the same)
        name = f"{self._names[id(optimizer)]}.{'all' if everywhere else 'node'}"
        if everywhere:  # one fused allreduce over every worker, on the global wire type
            group, compressor = self.groups.world, self.global_compressor
            scope = Scope.CROSS_NODE if self.groups.topology.num_nodes > 1 else Scope.NODE_LOCAL
        else:
            assert self.groups.local is not None
            group, compressor, scope = self.groups.local, self.node_compressor, Scope.NODE_LOCAL
        buckets = bucket_tensors(grads, self.bucket_bytes)
        sums = group_sum([flatten(bucket) for bucket in buckets], group, compressor, name, self.counters, scope)
        for total, bucket in zip(sums, buckets, strict=True):
            unflatten_into(total if self.op == "sum" else total.div_(group.size), bucket)


def make_gradient_sync(config: HorovodConfig, groups: NodeGroups | None, counters: CommCounters) -> GradientSync:
    """The gradient sync ``config`` asks for; ``groups`` are the partners of the node-aware syncs."""
    compressor = compressor_by_name(config.compression)
    if config.sync == "hierarchical" and not config.native_hierarchical:
        if groups is None:
            raise ValueError("sync='hierarchical' needs the node groups (build_node_groups) before its gradient sync")
        return HierarchicalGradientSync(
            groups,
            compressor,
            config.op,
            counters,
            compress_node_local=config.compress_node_local,
            bucket_bytes=config.bucket_bytes,
            flat_below_bytes=config.flat_below_bytes,
            tune_route=config.tune_hierarchical_route,
        )
    if config.sync == "daso":
        if groups is None:
            raise ValueError("sync='daso' needs the node groups (build_node_groups) before its gradient sync")
        assert config.daso is not None
        return DasoGradientSync(
            groups, compressor, config.daso.downcast, config.op, counters, bucket_bytes=config.bucket_bytes
        )
    scope = Scope.CROSS_NODE if horovod_torch().cross_size() > 1 else Scope.NODE_LOCAL
    return HorovodOptimizerSync(
        compressor, config.op, counters, scope, gradient_predivide_factor=config.gradient_predivide_factor
    )
