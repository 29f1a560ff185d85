"""``sync="hierarchical"``: the two-level allreduce per bucket, or Horovod's hook-driven flat one where faster.

On a slow link between nodes the two-level legs win; on a fast one Horovod's per-gradient
allreduces cost least. Both start from backward hooks while backward still runs: Horovod's per
gradient, the legs per bucket once backward has produced all of its gradients
(``comm.reducer``); what backward has not started when it ends starts then. With route
tuning the optimizer is wrapped by Horovod's ``DistributedOptimizer`` whose hooks are held on
two-level steps, so the kept route is exactly what ``sync="allreduce"`` does when flat wins.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from hvd_plugins.core.backend.optimizer import forget_held_gradients, hold_gradient_hooks, set_backward_passes
from hvd_plugins.core.comm.compression import Compressor
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.gradients import divide_gradients_
from hvd_plugins.core.comm.in_flight import InFlight, Then
from hvd_plugins.core.comm.reducer import BucketReducer, OptimizerReducers
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.comm.two_level import start_bucket_sum, write_total
from hvd_plugins.core.comm.world import average_over_world
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.sync.flat import HorovodOptimizerSync
from hvd_plugins.core.sync.hierarchical.route_tuning import FLAT, RouteTuner

log = logging.getLogger(__name__)


class HierarchicalGradientSync(GradientSync):
    """Two-level allreduce of bucketed gradients, each bucket started as backward completes it (``comm.two_level``).

    Buckets under ``flat_below_bytes`` take one flat allreduce instead of the three legs. With
    ``tune_route`` (and nodes of several workers) the first steps try both routes and keep the
    faster (``route_tuning``); the choice is printed once by rank 0 and kept in ``route_tuner``.
    """

    world_shaped = True  # its node groups are the old world's

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
        self.route_tuner: RouteTuner | None = None
        self.groups = groups
        self.topology = groups.topology
        self.compressor = compressor
        self.op = op
        self.counters = counters
        self.compress_node_local = compress_node_local
        self.bucket_bytes = bucket_bytes
        self.flat_below_bytes = flat_below_bytes
        self.tune_route = tune_route and groups.local is not None and groups.cross is not None
        self._flat = HorovodOptimizerSync(compressor, op, counters, Scope.CROSS_NODE) if self.tune_route else None
        """Horovod's own flat route (``sync="allreduce"``), for the optimizers it wraps while tuning."""
        self._names: dict[int, str] = {}  # by optimizer, in wrap order: equal on every rank
        self._hooked: list[Optimizer] = []  # DistributedOptimizers, whose hooks carry the flat route
        self._last_sync_end: float | None = None
        self._optimizers: list[Optimizer] = []  # every optimizer wrapped, in wrap order
        # buckets and sums, per optimizer
        self._reducers = OptimizerReducers(bucket_bytes, self._sum_bucket, counters=self.counters)

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        name = f"grad.opt{len(self._names)}"
        if self._flat is not None:
            self._flat.backward_passes = self.backward_passes
            optimizer = self._flat.wrap(optimizer, named_parameters)
            self._hooked.append(optimizer)
        self._names[id(optimizer)] = name
        self._optimizers.append(optimizer)
        self._arm_hooks(optimizer)
        return optimizer

    @contextlib.contextmanager
    def deferred(self, optimizer: Optimizer) -> Iterator[None]:
        if self._flat is not None and optimizer in self._hooked:
            with self._flat.deferred(optimizer):
                yield
        else:
            yield

    def synchronize(self, optimizer: Optimizer) -> None:
        tuner = self.route_tuner
        if self._flat is not None and optimizer in self._hooked and tuner is not None and tuner.route == FLAT:
            self._flat.synchronize(optimizer)
        else:
            if optimizer in self._hooked:
                forget_held_gradients(optimizer)
            tuner = self._two_level(optimizer)
        if tuner is not None and tuner.choice is None:
            now = time.perf_counter()
            tuner.record(None if self._last_sync_end is None else now - self._last_sync_end)
            self._last_sync_end = now
            if tuner.choice is not None and self.groups.topology.rank == 0:
                kept = "Horovod's flat allreduce" if tuner.choice == FLAT else "the two-level legs"
                log.info(
                    f"sync='hierarchical': training steps took {tuner.measured()}; gradients now "
                    f"take {kept}. Pass flat_below_mb=<MiB> to fix the route instead."
                )
        self._arm_hooks(optimizer)

    def _two_level(self, optimizer: Optimizer) -> RouteTuner | None:
        """Finish the buckets backward started, start and finish the rest; returns the tuner if one times it.

        Large buckets take the legs, small ones one flat allreduce. Parameters that became trainable
        after the buckets were built (a stale plan) are averaged after the planned ones.
        """
        reducer = self._reducer_for(optimizer)
        reducer.finish()
        self._reducers.reduce_late(optimizer, reducer)
        return self._tuner_for(reducer.bucket_nbytes())

    def _sum_bucket(self, index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
        """Start one bucket's sum over every worker (``comm.two_level``); it lands, averaged or summed, in ``flat``."""
        pending = start_bucket_sum(
            flat,
            self.groups,
            compression=self.compressor,
            compress_node_local=self.compress_node_local,
            counters=self.counters,
            name=name,
            flat_below_bytes=self.flat_below_bytes,
        )
        if pending is None:
            return None
        divide_by = self.groups.topology.size if self.op == "average" else None

        def written(total: torch.Tensor) -> torch.Tensor:
            write_total(flat, total, divide_by)
            return flat

        return Then(pending, written)

    def _reducer_for(self, optimizer: Optimizer) -> BucketReducer:
        return self._reducers.for_optimizer(optimizer, self._names[id(optimizer)], self.backward_passes)

    def _arm_hooks(self, optimizer: Optimizer) -> None:
        """Arm the hooks of the route the next step takes: Horovod's for flat, the buckets' for the legs."""
        tuner = self.route_tuner
        flat_next = tuner is not None and tuner.route == FLAT
        if optimizer in self._hooked:
            if flat_next:
                set_backward_passes(optimizer, self.backward_passes)
            else:
                hold_gradient_hooks(optimizer)
        self._reducer_for(optimizer).armed = not flat_next and self.groups.topology.size > 1

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        self.backward_passes = passes
        if optimizer in self._hooked:
            set_backward_passes(optimizer, passes)  # then held again unless the next step takes the flat route
        if (reducer := self._reducers.existing(optimizer)) is not None:
            reducer.set_backward_passes(passes)
        self._arm_hooks(optimizer)

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        if self._flat is not None and optimizer in self._hooked:
            self._flat.hold_next_backward(optimizer)
        if (reducer := self._reducers.existing(optimizer)) is not None:
            reducer.hold_next_backward()

    def before_backward(self, optimizer: Optimizer) -> None:
        """Before a backward: settle what an earlier backward of the step started, or follow new trainable parameters.

        Buckets in flight hold the earlier backward's gradients; a second backward before the step
        (accumulating the DDP way) adds to them. So those sums are finished first, as the flat route
        does: the gradients become their average, and the step averages again, giving the average
        of the gradients summed over the backward passes (``op="sum"``: divided by the workers first).
        """
        if self._flat is not None and optimizer in self._hooked:
            self._flat.before_backward(optimizer)  # the flat route's hooks; held ones started nothing
        reducer = self._reducers.existing(optimizer)
        if reducer is not None and reducer.in_flight:
            self._two_level(optimizer)
            if self.op == "sum":
                divide_gradients_(optimizer, self.groups.topology.size)
            self._arm_hooks(optimizer)
        elif id(optimizer) in self._names:
            self._arm_hooks(optimizer)  # buckets built again if the trainable parameters changed

    def on_train_epoch_start(self) -> None:
        self._last_sync_end = None  # the time since the last step holds an epoch end (validation)

    def state_dict(self) -> dict[str, Any]:
        """The measured route, once chosen: a resumed run keeps it instead of timing again."""
        tuner = self.route_tuner
        return {"route": tuner.state_dict()} if tuner is not None and tuner.choice is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("route") is not None:
            self.route_tuner = RouteTuner.restored(state["route"])
            for optimizer in self._optimizers:
                self._arm_hooks(optimizer)

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        if self._flat is not None:
            self._flat.teardown(self._hooked)
        self._reducers.remove_all()
        self._optimizers.clear()
        self._hooked.clear()
        self._names.clear()
        self._last_sync_end = None

    def _tuner_for(self, bucket_nbytes: Sequence[int]) -> RouteTuner | None:
        """The tuner when there is a choice to make: two-level legs exist and some bucket would take them.

        Bucket sizes and the layout are equal on every worker, so every worker decides alike.
        """
        if self.route_tuner is not None or not self.tune_route:
            return self.route_tuner
        if not any(size >= self.flat_below_bytes for size in bucket_nbytes):
            return None
        self.route_tuner = RouteTuner(lambda t: average_over_world(t, "hvd_plugins.route"))
        return self.route_tuner
