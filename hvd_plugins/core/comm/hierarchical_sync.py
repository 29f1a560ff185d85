"""``sync="hierarchical"``: the two-level allreduce after backward, or Horovod's hook-driven flat one where faster.

On a slow link between nodes the two-level legs win; on a fast one Horovod's per-gradient
allreduces, started by backward hooks while backward still runs, cost least. With route tuning the
optimizer is wrapped by Horovod's ``DistributedOptimizer`` whose hooks are held on two-level steps,
so the kept route is exactly what ``sync="allreduce"`` does when flat wins.
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
from hvd_plugins.core.comm.buckets import bucket_tensors, flatten, unflatten_into
from hvd_plugins.core.comm.compression import Compressor
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.gradient_sync import GradientSync, HorovodOptimizerSync, gradients_of
from hvd_plugins.core.comm.hierarchical import hierarchical_allreduce_
from hvd_plugins.core.comm.route_tuning import FLAT, RouteTuner
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.comm.wire import nbytes

log = logging.getLogger(__name__)


class HierarchicalGradientSync(GradientSync):
    """Two-level allreduce of bucketed gradients after backward (see ``comm.hierarchical``).

    Buckets under ``flat_below_bytes`` take one flat allreduce instead of the three legs. With
    ``tune_route`` (and nodes of several workers) the first steps try both routes and keep the
    faster (``comm.route_tuning``); the choice is printed once by rank 0 and kept in ``route_tuner``.
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

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        name = f"grad.opt{len(self._names)}"
        if self._flat is not None:
            self._flat.backward_passes = self.backward_passes
            optimizer = self._flat.wrap(optimizer, named_parameters)
            self._hooked.append(optimizer)
            self._arm_hooks(optimizer)
        self._names[id(optimizer)] = name
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
        if optimizer in self._hooked:
            self._arm_hooks(optimizer)

    def _two_level(self, optimizer: Optimizer) -> RouteTuner | None:
        """Average after backward: large buckets over the legs, small ones flat; returns the tuner if one times it."""
        grads = gradients_of(optimizer)
        buckets = bucket_tensors(grads, self.bucket_bytes)
        flats = [flatten(bucket) for bucket in buckets]
        tuner = self._tuner_for(flats)
        hierarchical_allreduce_(
            flats,
            self.groups,
            average=self.op == "average",
            compression=self.compressor,
            compress_node_local=self.compress_node_local,
            counters=self.counters,
            name=self._names[id(optimizer)],
            flat_below_bytes=self.flat_below_bytes,
        )
        for flat, bucket in zip(flats, buckets, strict=True):
            unflatten_into(flat, bucket)
        return tuner

    def _arm_hooks(self, optimizer: Optimizer) -> None:
        """Let the hooks start allreduces in the next step only if it takes the flat route."""
        tuner = self.route_tuner
        if tuner is not None and tuner.route == FLAT:
            set_backward_passes(optimizer, self.backward_passes)
        else:
            hold_gradient_hooks(optimizer)

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        self.backward_passes = passes
        if optimizer in self._hooked:
            set_backward_passes(optimizer, passes)  # then held again unless the next step takes the flat route
            self._arm_hooks(optimizer)

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        if self._flat is not None and optimizer in self._hooked:
            self._flat.hold_next_backward(optimizer)

    def before_backward(self, optimizer: Optimizer) -> None:
        if self._flat is not None and optimizer in self._hooked:
            self._flat.before_backward(optimizer)  # the flat route's hooks; held ones started nothing

    def on_train_epoch_start(self) -> None:
        self._last_sync_end = None  # the time since the last step holds an epoch end (validation)

    def state_dict(self) -> dict[str, Any]:
        """The measured route, once chosen: a resumed run keeps it instead of timing again."""
        tuner = self.route_tuner
        return {"route": tuner.state_dict()} if tuner is not None and tuner.choice is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("route") is not None:
            self.route_tuner = RouteTuner.restored(state["route"])
            for optimizer in self._hooked:
                self._arm_hooks(optimizer)

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        if self._flat is not None:
            self._flat.teardown(self._hooked)
        self._hooked.clear()
        self._names.clear()
        self._last_sync_end = None

    def _tuner_for(self, flats: Sequence[torch.Tensor]) -> RouteTuner | None:
        """The tuner when there is a choice to make: two-level legs exist and some bucket would take them.

        Bucket sizes and the layout are equal on every worker, so every worker decides alike.
        """
        if self.route_tuner is not None or not self.tune_route:
            return self.route_tuner
        if not any(nbytes(flat) >= self.flat_below_bytes for flat in flats):
            return None
        hvd = horovod_torch()
        self.route_tuner = RouteTuner(lambda t: hvd.allreduce(t, op=hvd.Average, name="hvd_plugins.route"))
        return self.route_tuner
