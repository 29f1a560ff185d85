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

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.buckets import bucket_tensors, flatten, unflatten_into
from hvd_plugins.core.comm.compression import Compressor, compressor_by_name
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.gradient_sync import GradientSync, gradients_of
from hvd_plugins.core.comm.partners import group_sum
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.daso.config import DasoConfig
from hvd_plugins.core.daso.parameter_sync import DasoParameterSync


class DasoGradientSync(GradientSync):
    """DASO's gradient average, and the owner of DASO's cross-node parameter sync (``daso``).

    After backward, the gradients (zero-filled where backward produced none, so every worker
    sends the same tensors and every parameter gets optimizer state) are bucketed and flattened;
    every bucket is launched before any is awaited, so Horovod fuses them into one round per
    step. Over all workers they travel as ``config.downcast`` ('fp16', or exact 'fp32'); inside the
    node with the strategy's compression. Which scope a step uses is the schedule's phase; before
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
        self.global_compressor = compressor_by_name("fp16" if config.downcast == "fp16" else "none")
        self.op = op
        self.counters = counters
        self.bucket_bytes = bucket_bytes
        self.daso: DasoParameterSync | None = None
        """The running fit's parameter syncer; ``daso.schedule`` is public for callbacks."""
        self._restored_schedule: Mapping[str, Any] | None = None
        self._names: dict[int, str] = {}  # by optimizer, in wrap order: equal on every rank

    def over_all_workers(self) -> bool:
        """Whether this step's gradients are averaged over all workers (warmup, cooldown) or in the node."""
        return self.daso is None or self.daso.gradients_over_all_workers()

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        self._names[id(optimizer)] = f"daso.grad.opt{len(self._names)}"
        return optimizer

    def synchronize(self, optimizer: Optimizer) -> None:
        grads = gradients_of(optimizer)
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
        self._names.clear()
