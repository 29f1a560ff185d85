"""HOW DASO syncs across nodes: sharded, chunked, downcast parameter averaging over process sets.

Gradients are already averaged inside each node every step (the strategy's node-local
``DistributedOptimizer``), so the workers of one node always hold the same parameters. Across
nodes, every ``global_skips`` steps:

1. every local worker ``i`` takes shard ``i`` of the flat trainable parameters (the cross-node
   message is split across all L local workers, not carried by one of them);
2. it sends ``shard - reference`` (see below), downcast, in chunks of at most
   ``sending_chunk_size`` elements, with a non-blocking Sum over its cross-node process set;
3. ``batches_to_wait`` (B) steps later it receives the sum and merges
   ``p = (2B * p_local + S) / (2B + N)`` on its shard (S = sum over the N nodes); with B = 0
   (warmup, cooldown, the last batch of every epoch) it waits at once and sets ``p = S / N``;
4. the node allgathers the shards so every local worker holds the same parameters again.

The reference: what goes on the wire is the difference between the parameters and the last
cross-node average (``reference``), which every node holds bit for bit. Sending
``p - reference`` instead of ``p`` keeps float16 rounding relative to the small drift since the
last sync, not to the weights themselves: sending weights in float16 every batch would round
away any update smaller than ~1e-3 of the weight. Mathematically ``S`` is unchanged:
``sum(p_n) = N * reference + sum(p_n - reference)``.

Wire types: ``fp16`` halves the bytes; ``fp32`` sends full precision; ``bf16`` rounds each value
to bfloat16 precision (what the reference implementation sends) but carries it as float32,
because Horovod cannot reduce bfloat16 tensors: bf16 numerics, fp32 bytes. Choose fp16 to save
bytes.

At every blocking sync the floating-point optimizer state (e.g. Adam's moments) is averaged
across nodes in float32 (moments such as ``exp_avg_sq`` underflow in float16), and floating
buffers (BatchNorm running statistics) are averaged over all workers, so after a blocking sync
every worker holds the same model and optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins._horovod import horovod_torch
from hvd_plugins.comm.buckets import flatten, unflatten_into
from hvd_plugins.comm.buffers import finish_buffer_average, start_buffer_average
from hvd_plugins.comm.counters import CommCounters, Scope
from hvd_plugins.comm.parameters import optimizer_parameters
from hvd_plugins.comm.topology import NodeGroups
from hvd_plugins.comm.wire import nbytes
from hvd_plugins.daso.config import DasoConfig
from hvd_plugins.daso.schedule import DasoSchedule, StepPlan


def to_wire(values: torch.Tensor, downcast: str) -> torch.Tensor:
    """What goes on the wire for ``downcast`` ('fp16', 'bf16' emulated in float32, or 'fp32')."""
    if downcast == "fp16":
        return values.to(torch.float16)
    if downcast == "bf16":
        return values.to(torch.bfloat16).to(torch.float32)
    return values.to(torch.float32)


@dataclass(frozen=True)
class ShardLayout:
    """How a flat vector of ``numel`` elements splits into ``parts`` equal shards (last one padded)."""

    numel: int
    parts: int
    index: int

    @property
    def shard_numel(self) -> int:
        return math.ceil(self.numel / self.parts) if self.numel else 0

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """A copy of this worker's shard of ``flat``, zero-padded to ``shard_numel``."""
        start = self.index * self.shard_numel
        piece = flat[start : start + self.shard_numel]
        padding = self.shard_numel - piece.numel()
        return torch.cat([piece, piece.new_zeros(padding)]) if padding else piece.clone()


@dataclass
class PendingSum:
    """A cross-node Sum in flight: one Horovod handle per chunk."""

    handles: list[Any]
    dtype: torch.dtype


class CrossNodeSharding:
    """Sum shards across nodes and reassemble them inside the node; counts every byte."""

    def __init__(self, groups: NodeGroups, counters: CommCounters, chunk_numel: int) -> None:
        self.groups = groups
        self.counters = counters
        self.chunk_numel = chunk_numel
        self.num_nodes = groups.topology.num_nodes
        # Allgather rows come in global-rank order; shards are numbered by local rank.
        node = groups.topology.node_ranks(groups.topology.node_index)
        self._shard_order_of_rows = torch.tensor([sorted(node).index(rank) for rank in node])

    def layout(self, numel: int) -> ShardLayout:
        topology = self.groups.topology
        sharded = self.groups.local is not None
        return ShardLayout(numel, topology.local_size if sharded else 1, topology.local_rank if sharded else 0)

    def start_sum(self, wire: torch.Tensor, name: str) -> PendingSum:
        """Start a non-blocking Sum of ``wire`` over this worker's cross-node set, chunk by chunk."""
        hvd = horovod_torch()
        chunks = wire.split(self.chunk_numel) if wire.numel() else ()
        handles = [
            hvd.allreduce_async(chunk, op=hvd.Sum, name=f"{name}.{index}", process_set=self.groups.cross)
            for index, chunk in enumerate(chunks)
        ]
        self.counters.record(Scope.CROSS_NODE, nbytes(wire), calls=len(handles))
        return PendingSum(handles, wire.dtype)

    def finish_sum(self, pending: PendingSum, dtype: torch.dtype) -> torch.Tensor:
        """Wait for a Sum and return it in ``dtype``."""
        hvd = horovod_torch()
        with self.counters.waiting():
            parts = [hvd.synchronize(handle) for handle in pending.handles]
        if not parts:
            return torch.empty(0, dtype=dtype)
        return torch.cat(parts).to(dtype)

    def gather_in_node(self, shards: Sequence[torch.Tensor], layouts: Sequence[ShardLayout]) -> list[torch.Tensor]:
        """Every local worker's shards, reassembled and unpadded: the full flat vectors.

        Several vectors travel in ONE allgather (one latency round): each worker sends its
        shards back to back, and the result is split column-wise per vector.
        """
        if self.groups.local is None:
            return [shard[: layout.numel] for shard, layout in zip(shards, layouts, strict=True)]
        hvd = horovod_torch()
        mine = torch.cat(list(shards))
        self.counters.record(Scope.NODE_LOCAL, nbytes(mine))
        with self.counters.waiting():
            rows = hvd.allgather(mine, name="daso.gather", process_set=self.groups.local)
        rows = rows.view(self.groups.topology.local_size, mine.numel())[self._shard_order_of_rows]
        full, offset = [], 0
        for shard, layout in zip(shards, layouts, strict=True):
            full.append(rows[:, offset : offset + shard.numel()].reshape(-1)[: layout.numel])
            offset += shard.numel()
        return full


class DasoSync:
    """Runs the cross-node half of DASO after each optimizer step, as the schedule says.

    The strategy calls :meth:`setup` once the optimizers are wrapped; its training-loop events
    (``hvd_plugins.loop_events``) call :meth:`after_optimizer_step` after every batch that stepped
    and :meth:`on_train_epoch_end` with the epoch's loss averaged over all workers.
    ``schedule`` is public for callbacks (phase, global_skips, batches_to_wait, history).
    """

    def __init__(self, config: DasoConfig, groups: NodeGroups, counters: CommCounters, total_epochs: int | None):
        self.config = config
        self.groups = groups
        self.counters = counters
        self.schedule = DasoSchedule(config, total_epochs)
        self.sharding = CrossNodeSharding(groups, counters, config.sending_chunk_size)
        self.blocking_syncs = 0
        self.merges = 0
        self._model: Module | None = None
        self._optimizers: list[Optimizer] = []
        self._parameters: list[torch.nn.Parameter] = []
        self._work_dtype = torch.float32
        self._layout = ShardLayout(0, 1, 0)
        self._reference = torch.empty(0)
        self._in_flight: PendingSum | None = None

    @property
    def across_nodes(self) -> bool:
        return self.groups.cross is not None

    def setup(self, model: Module, optimizers: Sequence[Optimizer]) -> None:
        """Remember what to sync; the parameters must already be equal on every worker."""
        self._model = model
        self._optimizers = list(optimizers)
        self._parameters = _unique(p for p in model.parameters() if p.requires_grad)
        if any(p.dtype == torch.float64 for p in self._parameters):
            self._work_dtype = torch.float64
        self._layout = self.sharding.layout(sum(p.numel() for p in self._parameters))
        self._reference = self._layout.shard_of(self._flat_parameters())

    # ------------------------------------------------------------------ events
    def after_optimizer_step(self, last_batch_of_epoch: bool) -> None:
        self._carry_out(self.schedule.on_optimizer_step(last_batch_of_epoch))

    def on_train_epoch_end(self, epoch_loss: float | None) -> None:
        """Settle what the epoch still owes, then let the schedule pick the next epoch's settings."""
        self._carry_out(self.schedule.finish_epoch())
        before = (self.schedule.phase, self.schedule.global_skips, self.schedule.batches_to_wait)
        self.schedule.end_epoch(epoch_loss)
        after = (self.schedule.phase, self.schedule.global_skips, self.schedule.batches_to_wait)
        if self.config.verbose and after != before and horovod_torch().rank() == 0:
            print(
                f"DASO epoch {self.schedule.epoch}: phase={after[0].value} global_skips={after[1]} "
                f"batches_to_wait={after[2]} (loss {epoch_loss})",
                flush=True,
            )

    def _carry_out(self, plan: StepPlan) -> None:
        if plan.receive:
            self._receive(merge=not plan.blocking, batches_to_wait=plan.merge_wait)
        if plan.blocking:
            self._blocking_sync()
        if plan.send:
            self._send()

    # ------------------------------------------------------------------ parameters
    def _flat_parameters(self) -> torch.Tensor:
        return _flatten_as(self._parameters, self._work_dtype)

    def _send(self) -> None:
        if not self.across_nodes:
            return
        drift = self._layout.shard_of(self._flat_parameters()) - self._reference
        self._in_flight = self.sharding.start_sum(to_wire(drift, self.config.downcast), "daso.params")

    def _average_of_sent(self, pending: PendingSum) -> torch.Tensor:
        """The cross-node average of the parameters when they were sent (the same on every node)."""
        drift_sum = self.sharding.finish_sum(pending, self._work_dtype)
        return self._reference + drift_sum / self.sharding.num_nodes

    def _receive(self, merge: bool, batches_to_wait: int) -> None:
        """Wait for the message in flight; merge it unless a blocking sync supersedes it."""
        if self._in_flight is None:
            return
        average = self._average_of_sent(self._in_flight)
        self._in_flight = None
        self._reference = average
        if not merge:
            return
        local = self._layout.shard_of(self._flat_parameters())
        weight, nodes = 2 * batches_to_wait, self.sharding.num_nodes
        merged = (weight * local + nodes * average) / (weight + nodes)
        self._install(merged)
        self.merges += 1

    def _blocking_sync(self) -> None:
        """``p = S / N`` plus optimizer state and buffers; all messages start before any wait."""
        self.blocking_syncs += 1
        scope = Scope.CROSS_NODE if self.across_nodes else Scope.NODE_LOCAL
        model = self._model
        buffers = None if model is None else start_buffer_average(model, "daso.buffers", self.counters, scope)
        if self.across_nodes:
            drift = self._layout.shard_of(self._flat_parameters()) - self._reference
            params = self.sharding.start_sum(to_wire(drift, self.config.downcast), "daso.params_blocking")
            state_tensors = _optimizer_state_tensors(self._optimizers)
            state_flat = _flatten_as(state_tensors, self._work_dtype)
            state_layout = self.sharding.layout(state_flat.numel())
            state = self.sharding.start_sum(state_layout.shard_of(state_flat), "daso.optimizer_state")
            self._reference = self._average_of_sent(params)
            state_average = self.sharding.finish_sum(state, self._work_dtype) / self.sharding.num_nodes
            full_params, full_state = self.sharding.gather_in_node(
                [self._reference, state_average], [self._layout, state_layout]
            )
            with torch.no_grad():
                unflatten_into(full_params, self._parameters)
                unflatten_into(full_state, state_tensors)
        finish_buffer_average(buffers)

    def _install(self, shard: torch.Tensor) -> None:
        """Assemble the node's shards and write them into the parameters."""
        (full,) = self.sharding.gather_in_node([shard], [self._layout])
        with torch.no_grad():
            unflatten_into(full, self._parameters)


def _flatten_as(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return flatten([t.detach().to(dtype) for t in tensors])


def _unique(parameters: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    unique = []
    for parameter in parameters:
        if id(parameter) not in seen:
            seen.add(id(parameter))
            unique.append(parameter)
    return unique


def _optimizer_state_tensors(optimizers: Sequence[Optimizer]) -> list[torch.Tensor]:
    """Floating-point state tensors of every optimizer, in the same order on every worker."""
    tensors = []
    for optimizer in optimizers:
        for parameter in optimizer_parameters(optimizer):
            state = optimizer.state.get(parameter, {})
            for key in sorted(state, key=str):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    tensors.append(value)
    return tensors
