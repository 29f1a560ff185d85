"""``sync="hierarchical"``: the two-level allreduce per bucket, or Horovod's hook-driven flat one where faster.

On a slow link between nodes the two-level legs win; on a fast one Horovod's per-gradient
allreduces cost least. Both start from backward hooks while backward still runs: Horovod's per
gradient, the legs per bucket once backward has produced all of its gradients
(``comm.backward_buckets``); what backward has not started when it ends starts then. With route
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

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.optimizer import forget_held_gradients, hold_gradient_hooks, set_backward_passes
from hvd_plugins.core.comm.backward_buckets import BackwardBuckets
from hvd_plugins.core.comm.buckets import bucket_tensors, flatten, unflatten_into
from hvd_plugins.core.comm.compression import Compressor
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.gradient_sync import (
    GradientSync,
    HorovodOptimizerSync,
    divide_gradients_,
    gradient_to_send,
)
from hvd_plugins.core.comm.hierarchical import (
    PendingSum,
    finish_all,
    hierarchical_allreduce_,
    start_bucket_sum,
    write_total,
)
from hvd_plugins.core.comm.parameters import optimizer_parameters
from hvd_plugins.core.comm.route_tuning import FLAT, RouteTuner
from hvd_plugins.core.comm.topology import NodeGroups

InFlight = tuple[torch.Tensor, list[torch.Tensor], PendingSum | None]
"""A bucket's sum under way: its flattened gradients, the gradients to write the result into, the sum."""

log = logging.getLogger(__name__)


class HierarchicalGradientSync(GradientSync):
    """Two-level allreduce of bucketed gradients, each bucket started as backward completes it (``comm.hierarchical``).

    Buckets under ``flat_below_bytes`` take one flat allreduce instead of the three legs. With
    ``tune_route`` (and nodes of several workers) the first steps try both routes and keep the
    faster (``comm.route_tuning``); the choice is printed once by rank 0 and kept in ``route_tuner``.
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
        self._buckets: dict[int, BackwardBuckets] = {}  # by optimizer: the buckets its backward fills
        self._in_flight: dict[int, dict[int, InFlight]] = {}  # by optimizer, by bucket: sums started this step

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
        buckets = self._buckets_for(optimizer)
        in_flight = self._in_flight.setdefault(id(optimizer), {})
        for index in range(len(buckets.buckets)):
            if index not in in_flight:
                self._start_bucket(optimizer, index)
        started = [in_flight[index] for index in sorted(in_flight)]
        finish_all([sum_ for _, _, sum_ in started if sum_ is not None])
        divide_by = self.groups.topology.size if self.op == "average" else None
        for flat, gradients, sum_ in started:
            if sum_ is not None:
                write_total(flat, sum_.total, divide_by)
                unflatten_into(flat, gradients)
        in_flight.clear()
        buckets.reset(self.backward_passes)
        self._average_late_parameters(optimizer, buckets)
        return self._tuner_for(buckets.bucket_nbytes())

    def _average_late_parameters(self, optimizer: Optimizer, buckets: BackwardBuckets) -> None:
        """Average the trainable parameters the buckets do not hold (made trainable while their sums ran)."""
        trainable = optimizer_parameters(optimizer, trainable_only=True)
        if buckets.matches(trainable):
            return
        planned = set(buckets.parameters)
        late = [gradient_to_send(p) for p in trainable if p not in planned]
        if not late:
            return
        groups = bucket_tensors(late, self.bucket_bytes)
        flats = [flatten(group) for group in groups]
        hierarchical_allreduce_(
            flats,
            self.groups,
            average=self.op == "average",
            compression=self.compressor,
            compress_node_local=self.compress_node_local,
            counters=self.counters,
            name=f"{self._names[id(optimizer)]}.late",
            flat_below_bytes=self.flat_below_bytes,
        )
        for flat, group in zip(flats, groups, strict=True):
            unflatten_into(flat, group)

    def _start_bucket(self, optimizer: Optimizer, index: int) -> None:
        """Flatten one bucket's gradients and start its sum (from a backward hook, or after backward)."""
        buckets = self._buckets[id(optimizer)]
        gradients = [gradient_to_send(p) for p in buckets.buckets[index]]
        flat = flatten(gradients)
        sum_ = start_bucket_sum(
            flat,
            self.groups,
            compression=self.compressor,
            compress_node_local=self.compress_node_local,
            counters=self.counters,
            name=f"{self._names[id(optimizer)]}.{index}",
            flat_below_bytes=self.flat_below_bytes,
        )
        in_flight = self._in_flight.setdefault(id(optimizer), {})
        in_flight[index] = (flat, gradients, sum_)
        for _, _, other in in_flight.values():  # let earlier buckets move on to their next legs
            if other is not None and not other.finished:
                other.progress()

    def _buckets_for(self, optimizer: Optimizer) -> BackwardBuckets:
        """The optimizer's buckets, built again when its trainable parameters changed and no bucket is in flight."""
        trainable = optimizer_parameters(optimizer, trainable_only=True)
        buckets = self._buckets.get(id(optimizer))
        if buckets is not None and (buckets.matches(trainable) or self._in_flight.get(id(optimizer))):
            return buckets
        if buckets is not None:
            buckets.remove()
        buckets = BackwardBuckets(
            trainable, self.bucket_bytes, lambda index: self._start_bucket(optimizer, index), self.backward_passes
        )
        self._buckets[id(optimizer)] = buckets
        return buckets

    def _arm_hooks(self, optimizer: Optimizer) -> None:
        """Arm the hooks of the route the next step takes: Horovod's for flat, the buckets' for the legs."""
        tuner = self.route_tuner
        flat_next = tuner is not None and tuner.route == FLAT
        if optimizer in self._hooked:
            if flat_next:
                set_backward_passes(optimizer, self.backward_passes)
            else:
                hold_gradient_hooks(optimizer)
        buckets = self._buckets_for(optimizer)
        buckets.armed = not flat_next and self.groups.topology.size > 1

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        self.backward_passes = passes
        if optimizer in self._hooked:
            set_backward_passes(optimizer, passes)  # then held again unless the next step takes the flat route
        if id(optimizer) in self._buckets:
            self._buckets[id(optimizer)].reset(passes)
        self._arm_hooks(optimizer)

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        if self._flat is not None and optimizer in self._hooked:
            self._flat.hold_next_backward(optimizer)
        if id(optimizer) in self._buckets:
            self._buckets[id(optimizer)].passes_needed += 1  # the countdown of every parameter gains one

    def before_backward(self, optimizer: Optimizer) -> None:
        """Before a backward: settle what an earlier backward of the step started, or follow new trainable parameters.

        Buckets in flight hold the earlier backward's gradients; a second backward before the step
        (accumulating the DDP way) adds to them. So those sums are finished first, as the flat route
        does: the gradients become their average, and the step averages again, giving the average
        of the gradients summed over the backward passes (``op="sum"``: divided by the workers first).
        """
        if self._flat is not None and optimizer in self._hooked:
            self._flat.before_backward(optimizer)  # the flat route's hooks; held ones started nothing
        if self._in_flight.get(id(optimizer)):
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
        for buckets in self._buckets.values():
            buckets.remove()
        self._buckets.clear()
        self._in_flight.clear()
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
        hvd = horovod_torch()
        self.route_tuner = RouteTuner(lambda t: hvd.allreduce(t, op=hvd.Average, name="hvd_plugins.route"))
        return self.route_tuner
