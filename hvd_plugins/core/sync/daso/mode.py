"""DASO as a sync mode: its gradient average, and the parameter syncer and schedule it owns and drives.

The gradient half runs after every backward: over ALL workers in warmup and cooldown, inside the
node while cycling. The parameter half (``DasoParameterSync``) runs after each optimizer step and at each
epoch's end; the schedule it holds is what a checkpoint keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.comm.compression import Compressor, compressor_by_name
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.gradients import divide_gradients_
from hvd_plugins.core.comm.in_flight import InFlight, Then
from hvd_plugins.core.comm.partners import GroupSum, PartnerGroup
from hvd_plugins.core.comm.reducer import BucketReducer, OptimizerReducers
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.comm.world import world_size
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.sync.daso.config import DasoConfig
from hvd_plugins.core.sync.daso.parameter_sync import DasoParameterSync


class DasoGradientSync(GradientSync):
    """DASO's gradient average, and the owner of DASO's cross-node parameter sync (``daso``).

    The gradients (zero-filled where backward produced none, so every worker sends the same
    tensors and every parameter gets optimizer state) are bucketed in the optimizer's order by the
    shared reducer (``comm.reducer``); each bucket's sum starts as backward completes it, the rest
    after backward, and all are launched before any is awaited, so Horovod fuses them. Over all
    workers they travel as ``config.downcast`` ('fp16', or exact 'fp32'); inside the node with the
    strategy's compression. Which scope a step uses is the schedule's phase; before
    ``setup`` every step averages over all workers.
    """

    world_shaped = True  # its node groups are the old world's

    def __init__(
        self,
        config: DasoConfig,
        groups: NodeGroups,
        node_compressor: Compressor,
        op: str,
        counters: CommCounters,
        bucket_bytes: int = 32 * 2**20,
    ) -> None:
        if op not in ("average", "sum"):
            raise ValueError(f"op={op!r} is not supported with sync='daso'; choose 'average' or 'sum'")
        self.config = config
        self.groups = groups
        self.topology = groups.topology
        self.node_compressor = node_compressor
        self.global_compressor = compressor_by_name("none" if config.downcast == "fp32" else config.downcast)
        self.op = op
        self.counters = counters
        self.bucket_bytes = bucket_bytes
        self.daso: DasoParameterSync | None = None
        """The running fit's parameter syncer; ``daso.schedule`` is public for callbacks."""
        self._restored_schedule: Mapping[str, Any] | None = None
        self._names: dict[int, str] = {}  # by optimizer, in wrap order: equal on every rank
        self._reducers = OptimizerReducers(bucket_bytes, self._sum_bucket, backward_order=False, counters=self.counters)

    def over_all_workers(self) -> bool:
        """Whether this step's gradients are averaged over all workers (warmup, cooldown) or in the node."""
        return self.daso is None or self.daso.gradients_over_all_workers()

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        self._names[id(optimizer)] = f"daso.grad.opt{len(self._names)}"
        self._arm(optimizer)
        return optimizer

    def synchronize(self, optimizer: Optimizer) -> None:
        self._reducer_for(optimizer).finish(waiting=self.counters.waiting())
        self._arm(optimizer)

    def _group(self) -> tuple[PartnerGroup, Compressor, Scope] | None:
        """The group this step's gradients are averaged over, their wire compression and scope; None: alone."""
        everywhere = self.over_all_workers()
        if world_size() == 1 or (self.groups.local is None and not everywhere):
            return None  # alone in its group: nothing to average (the gradients are zero-filled all the same)
        if everywhere:  # over every worker, on the global wire type
            scope = Scope.CROSS_NODE if self.groups.topology.num_nodes > 1 else Scope.NODE_LOCAL
            return self.groups.world, self.global_compressor, scope
        assert self.groups.local is not None
        return self.groups.local, self.node_compressor, Scope.NODE_LOCAL

    def _sum_bucket(self, index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
        """Start one bucket's sum over this step's group; it lands averaged (or summed, ``op="sum"``)."""
        chosen = self._group()
        if chosen is None:
            return None
        group, compressor, scope = chosen
        sum_ = GroupSum(flat, group, compressor, f"{name}.{'all' if group.spans_world else 'node'}")
        if sum_.nbytes:
            self.counters.record(scope, sum_.nbytes)
        return sum_ if self.op == "sum" else Then(sum_, lambda total: total.div_(group.size))

    def _reducer_for(self, optimizer: Optimizer) -> BucketReducer:
        return self._reducers.for_optimizer(optimizer, self._names[id(optimizer)], self.backward_passes)

    def _arm(self, optimizer: Optimizer) -> None:
        """Let backward start the buckets (the trainable parameters may have changed: the reducer follows)."""
        self._reducer_for(optimizer).armed = world_size() > 1

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        self.backward_passes = passes
        if (reducer := self._reducers.existing(optimizer)) is not None:
            reducer.set_backward_passes(passes)

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        if (reducer := self._reducers.existing(optimizer)) is not None:
            reducer.hold_next_backward()

    def before_backward(self, optimizer: Optimizer) -> None:
        """A second backward before the step (accumulating the DDP way) settles the sums the first started.

        The gradients become their average over the group and the step averages again, which is the
        average of the gradients summed over the passes (``op="sum"``: divided by the group first).
        """
        reducer = self._reducers.existing(optimizer)
        if reducer is None or not reducer.in_flight:
            return
        chosen = self._group()
        reducer.finish(waiting=self.counters.waiting())
        if self.op == "sum" and chosen is not None:
            divide_gradients_(optimizer, chosen[0].size)
        self._arm(optimizer)

    # ------------------------------------------------------------------ training-loop hooks
    def setup(self, model: Module, optimizers: Sequence[Optimizer], total_epochs: int | None) -> None:
        """A fresh syncer per fit; its schedule continues from a checkpoint when one was loaded."""
        self.daso = DasoParameterSync(self.config, self.groups, self.counters, total_epochs=total_epochs)
        self.daso.setup(model, optimizers)
        if self._restored_schedule is not None:
            self.daso.schedule.load_state_dict(dict(self._restored_schedule))
            self._restored_schedule = None

    def on_train_epoch_start(self) -> None:
        if self.daso is not None:
            self.daso.on_train_epoch_start()

    def on_train_batch_start(self) -> None:
        if self.daso is not None:
            self.daso.on_train_batch_start()

    def after_optimizer_step(self, last_batch_of_epoch: bool) -> None:
        if self.daso is not None:
            self.daso.after_optimizer_step(last_batch_of_epoch=last_batch_of_epoch)

    def on_train_epoch_end(self, epoch_loss: Callable[[], float | None]) -> None:
        if self.daso is not None:
            self.daso.on_train_epoch_end(epoch_loss)

    def state_dict(self) -> dict[str, Any]:
        return {"daso_schedule": self.daso.schedule.state_dict()} if self.daso is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        schedule = state.get("daso_schedule")
        if schedule is not None and self.daso is not None:
            self.daso.schedule.load_state_dict(dict(schedule))
        elif schedule is not None:
            self._restored_schedule = schedule

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        self.daso = None
        self._reducers.remove_all()
        self._names.clear()
