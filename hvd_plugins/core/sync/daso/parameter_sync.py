"""DASO's cross-node half: WHEN and WHAT parameters and state are averaged across nodes (the bytes move in
``comm.cross_node``).

Warmup and cooldown (synchronous phases): ``DasoGradientSync`` averages every step's gradients
over ALL workers in one fused round, so every worker applies the same update and parameters
and optimizer state stay bit-identical; no parameter sync runs. Floating buffers (BatchNorm
running statistics) follow each worker's batches and are averaged over all workers once, at the
end of the epoch, as the flat allreduce does.

Cycling: gradients are averaged inside the node only, so the workers of one node hold the same
parameters and optimizer state while the nodes drift apart. Across nodes, every
``global_skips`` steps:

1. every local worker ``i`` takes shard ``i`` of the flat trainable parameters (the cross-node
   message is split across all L local workers, not carried by one of them);
2. it sends ``shard - reference`` (see below), downcast, in chunks of at most
   ``sending_chunk_size`` elements, with a non-blocking Sum over its peers on the other nodes
   (the workers with its local rank);
3. ``batches_to_wait`` (B >= 1) steps later it receives the sum of its shard, still in the wire
   type (every cross-node sum ends in it, so nothing is rounded);
4. the node allgathers those sums (one round; a quarter of the bytes of gathering merged fp32
   shards and the reference with fp16, half with fp32 or bf16), and every local worker merges
   ``p = (2B * p_local + S) / (2B + N)`` on the whole vector itself (S = sum over the N nodes).
   The workers of a node hold the same parameters and reference and gather the same sum, so they
   hold the same parameters again.

The epoch's last batch (and whatever ``finish_epoch`` says is still owed) runs a BLOCKING sync:
parameters and the optimizer state are averaged across nodes (the state only before a synchronous
epoch with ``average_optimizer_state=False``), and the floating buffers over all workers. The
workers of a node hold the same parameters and state, so their average over all workers is their
average over nodes: each local worker sums its shard of them across nodes (one message per wire
type, at most two: the parameters' downcast type, and float32 for the state, float64 with float64
parameters), then the node gathers the sums, as a merge does; a node's bytes
between nodes are one copy, not one per worker. Buffers follow each worker's own batches, so they
are averaged over all workers. Afterwards parameters, buffers and (when averaged) the optimizer
state are bit-identical on every worker, so every epoch starts from one model.

The reference: what goes on the wire is the difference between the parameters and the last
cross-node average (``reference``), which every worker holds bit for bit. Sending
``p - reference`` instead of ``p`` keeps float16 rounding relative to the small drift since the
last sync, not to the weights themselves: sending weights in float16 every batch would round
away any update smaller than ~1e-3 of the weight. Mathematically ``S`` is unchanged:
``sum(p_n) = N * reference + sum(p_n - reference)``.

Wire types: ``fp16`` and ``bf16`` (what the reference implementation sends; it needs a Horovod
that takes bfloat16, which ``hvd-build-horovod`` builds) halve the bytes; ``fp32`` sends full
precision. Optimizer state travels in float32 (moments such as ``exp_avg_sq`` underflow in
float16), or in the downcast type with ``downcast_optimizer_state=True``; only state that lives
with its parameter (same shape and device) is averaged, never a step count.

Trainable parameters are collected again at every epoch start (every rank is there together),
so parameters unfrozen between epochs (Lightning's ``BaseFinetuning``) join the cross-node sync;
newly trainable ones are averaged over all workers first. ``requires_grad`` must change on every
rank at the same epoch start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.comm.buffers import BufferAverage, finish_buffer_average, start_buffer_average
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.cross_node import ChunkedSum, CrossNodeSharding
from hvd_plugins.core.comm.layout import FlatLayout, flatten, unflatten_into
from hvd_plugins.core.comm.parameters import optimizer_parameters
from hvd_plugins.core.comm.shards import ShardLayout
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.comm.wire import nbytes
from hvd_plugins.core.comm.world import average_over_world, world_rank, world_size
from hvd_plugins.core.sync.daso.config import DasoConfig
from hvd_plugins.core.sync.daso.cycling_probe import CyclingProbe
from hvd_plugins.core.sync.daso.schedule import DasoSchedule, Phase, StepPlan

log = logging.getLogger(__name__)


WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def to_wire(values: torch.Tensor, downcast: str) -> torch.Tensor:
    """What goes on the wire for ``downcast`` ('fp16', 'bf16' or 'fp32')."""
    return values.to(WIRE_DTYPES[downcast])


class DasoParameterSync:
    """Runs the cross-node half of DASO after each optimizer step, as the schedule says.

    ``DasoGradientSync`` calls :meth:`setup` once the optimizers exist and asks
    :meth:`gradients_over_all_workers` at every step; from the training loop's hooks it calls
    :meth:`on_train_epoch_start`, :meth:`after_optimizer_step` after every batch that stepped and
    :meth:`on_train_epoch_end` with the callable that gives the epoch's loss averaged over all workers
    (the signature of ``TrainingLoopHooks``).
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
        self._reference = torch.empty(0)  # the full flat parameters of the last cross-node average
        self._in_flight: ChunkedSum | None = None
        self.probe = CyclingProbe(_average_over_workers) if config.cycling == "auto" else None
        """Times cycling against synchronous steps (``DasoConfig.cycling="auto"``); None once it has judged."""

    @property
    def across_nodes(self) -> bool:
        return self.groups.cross is not None

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters the cross-node sync covers this epoch."""
        return list(self._parameters)

    def gradients_over_all_workers(self) -> bool:
        """Whether this step's gradients are averaged over all workers (warmup, cooldown) or in the node."""
        return self.schedule.phase.synchronous

    def setup(self, model: Module, optimizers: Sequence[Optimizer]) -> None:
        """Remember what to sync; the parameters must already be equal on every worker."""
        self._model = model
        self._optimizers = list(optimizers)
        self._collect_parameters()

    def _collect_parameters(self) -> list[torch.nn.Parameter]:
        """Re-read the trainable parameters; returns the ones that were not trainable before."""
        assert self._model is not None
        known = {id(p) for p in self._parameters}
        self._parameters = _unique(p for p in self._model.parameters() if p.requires_grad)
        self._work_dtype = torch.float64 if any(p.dtype == torch.float64 for p in self._parameters) else torch.float32
        self._layout = self.sharding.layout(sum(p.numel() for p in self._parameters))
        self._reference = self._flat_parameters()
        return [p for p in self._parameters if id(p) not in known]

    # ------------------------------------------------------------------ events
    def on_train_epoch_start(self) -> None:
        """Follow ``requires_grad`` changes made between epochs; average newly trainable parameters.

        Every epoch starts with all workers holding the same parameters, so the reference is
        refreshed here too (after a synchronous epoch it was not kept up to date).
        """
        if self.probe is not None:
            self.probe.epoch_started()
        if self._model is None:
            return
        added = self._collect_parameters()
        if added and world_size() > 1:
            flat = _flatten_as(added, self._work_dtype)
            self.counters.record(self._global_scope, nbytes(flat))
            with self.counters.waiting():
                averaged = average_over_world(flat, "daso.unfrozen")
            with torch.no_grad():
                unflatten_into(averaged, added)
            self._reference = self._flat_parameters()

    def on_train_batch_start(self) -> None:
        """A relayed parameter sum in flight starts its way back now, to travel behind this batch's compute."""
        if self._in_flight is not None:
            self._in_flight.progress()

    def after_optimizer_step(self, last_batch_of_epoch: bool) -> None:
        self._carry_out(self.schedule.on_optimizer_step(last_batch_of_epoch))
        if self.probe is not None:
            self.probe.step_ended(self.schedule.phase.synchronous, time.perf_counter())

    def on_train_epoch_end(self, epoch_loss: Callable[[], float | None]) -> None:
        """Settle what the epoch still owes, then let the schedule pick the next epoch's settings.

        ``epoch_loss()`` is the all-worker mean loss (a collective): every worker asks it, so every
        worker's schedule sees the same value.
        """
        loss = epoch_loss()
        if self.schedule.phase.synchronous:
            finish_buffer_average(self._start_buffer_average())
        declined = self._judge_cycling()
        self._carry_out(self.schedule.finish_epoch())
        if declined and not self.config.average_optimizer_state and self.across_nodes:
            self._average_over_nodes(with_state=True)  # the closing sync kept each node's state: one for all now
        before = (self.schedule.phase, *self.schedule.settings)
        self.schedule.end_epoch(loss)
        after = (self.schedule.phase, *self.schedule.settings)
        if self.config.verbose and after != before and world_rank() == 0:
            log.info(
                f"DASO epoch {self.schedule.epoch}: phase={after[0].value} global_skips={after[1]} "
                f"local_skips={after[2]} batches_to_wait={after[3]} (loss {loss})"
            )

    def _judge_cycling(self) -> bool:
        """After the first cycling epoch that another would follow: keep cycling only where it paid. Returns
        whether it was declined now (every later epoch that would cycle then runs synchronous)."""
        probe = self.probe
        next_epoch_cycles = self.schedule.phase_of(self.schedule.epoch + 1) is Phase.CYCLING
        if probe is None or self.schedule.phase is not Phase.CYCLING or not next_epoch_cycles:
            return False
        self.probe = None  # one verdict a fit
        if probe.cycling_pays():
            return False
        self.schedule.decline_cycling()
        if world_rank() == 0:
            log.info(
                f"DASO: {probe.measured()}; later epochs average gradients over all workers, as warmup does "
                "(DasoConfig(cycling='always') keeps cycling)"
            )
        return True

    def _carry_out(self, plan: StepPlan) -> None:
        if plan.receive:
            self._receive(merge=not plan.blocking, batches_to_wait=plan.merge_wait)
        if plan.blocking:
            self._blocking_sync()
        if plan.send:
            self._send()

    # ------------------------------------------------------------------ parameters
    @property
    def _global_scope(self) -> Scope:
        return Scope.CROSS_NODE if self.groups.topology.num_nodes > 1 else Scope.NODE_LOCAL

    def _flat_parameters(self) -> torch.Tensor:
        return _flatten_as(self._parameters, self._work_dtype)

    def _send(self) -> None:
        if not self.across_nodes:
            return
        drift = self._layout.shard_of(self._flat_parameters() - self._reference)
        self._in_flight = self.sharding.start_sum(to_wire(drift, self.config.downcast), "daso.params")

    def _receive(self, merge: bool, batches_to_wait: int) -> None:
        """Wait for the message in flight; merge it unless a blocking sync supersedes it."""
        if self._in_flight is None:
            return
        pending, self._in_flight = self._in_flight, None
        drift_sum = self.sharding.finish_sums([pending])[0]
        if not merge:
            return  # the blocking sync that follows averages the current parameters instead
        full_sum = self.sharding.gather_in_node(drift_sum, self._layout)
        weight, nodes = 2 * batches_to_wait, self.sharding.num_nodes
        average = full_sum.to(self._work_dtype).div_(nodes).add_(self._reference)
        self._reference = average
        with torch.no_grad():
            move_towards(self._parameters, average, nodes / (weight + nodes))
        self.merges += 1

    def _start_buffer_average(self) -> BufferAverage | None:
        if self._model is None:
            return None
        return start_buffer_average(self._model, "daso.buffers", self.counters, self._global_scope)

    def _blocking_sync(self) -> None:
        """Average parameters, optimizer state and buffers over all workers.

        The workers of a node hold the same parameters and optimizer state (their gradients were
        averaged inside the node), so the average over all workers is the average over nodes:
        each local worker carries one shard across (``sum_node_copies``), one message per wire
        type. Buffers follow each worker's own batches and are averaged over all workers.
        """
        self.blocking_syncs += 1
        if world_size() == 1:
            return
        buffers = self._start_buffer_average()
        if self.across_nodes:
            self._average_over_nodes(with_state=self._state_owed())
        finish_buffer_average(buffers)

    def _state_owed(self) -> bool:
        """Whether this closing sync averages the optimizer state: always, unless the config keeps it per
        node, and then still before a synchronous epoch (its steps must be identical everywhere)."""
        next_phase = self.schedule.phase_of(self.schedule.epoch + 1)
        return self.config.average_optimizer_state or next_phase.synchronous

    def _average_over_nodes(self, with_state: bool) -> None:
        state_tensors = optimizer_state_to_average(self._optimizers) if with_state else []
        drift = to_wire(self._flat_parameters() - self._reference, self.config.downcast)
        state_dtype = drift.dtype if self.config.downcast_optimizer_state else self._work_dtype
        state = _flatten_as(state_tensors, state_dtype)
        messages = [drift, state] if state.dtype != drift.dtype else [torch.cat([drift, state])]
        sums = self.sharding.sum_node_copies([m for m in messages if m.numel()], "daso.blocking")
        nodes = self.sharding.num_nodes
        results = [total.to(self._work_dtype).div_(nodes) for total in sums]
        if len(results) == 2:
            drift_average, state_average = results
        else:  # one message (one wire type for both, or nothing of one of them): split it where the drift ends
            combined = results[0] if results else torch.empty(0, dtype=self._work_dtype)
            drift_average, state_average = combined[: drift.numel()], combined[drift.numel() :]
        self._reference = self._reference + drift_average
        with torch.no_grad():
            unflatten_into(self._reference, self._parameters)
            unflatten_into(state_average, state_tensors)


def _average_over_workers(values: torch.Tensor) -> torch.Tensor:
    return average_over_world(values, "daso.cycling_probe")


def move_towards(parameters: Sequence[torch.Tensor], target: torch.Tensor, share: float) -> None:
    """``p += share * (target - p)`` for each parameter and its slice of the flat ``target``, in place.

    The merge ``(2B * p + N * average) / (2B + N)`` is this with ``share = N / (2B + N)``: one pass
    over each parameter, with no flat copy of the parameters to build and copy back.
    """
    for parameter, part in zip(parameters, FlatLayout.of(parameters).views(target), strict=True):
        parameter.lerp_(part.to(parameter.dtype), share)


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


def optimizer_state_to_average(optimizers: Sequence[Optimizer]) -> list[torch.Tensor]:
    """The optimizer state that lives with its parameter, in the same order on every worker.

    Only floating tensors with the parameter's shape and device (Adam's moments, SGD's momentum):
    a step count (Adam keeps ``step`` as a CPU scalar even for GPU parameters) or any other
    bookkeeping is never averaged, and cannot break the flattening by living on another device.
    """
    tensors = []
    for optimizer in optimizers:
        for parameter in optimizer_parameters(optimizer):
            state = optimizer.state.get(parameter, {})
            for key in sorted(state, key=str):
                value = state[key]
                if (
                    key != "step"
                    and isinstance(value, torch.Tensor)
                    and value.is_floating_point()
                    and value.shape == parameter.shape
                    and value.device == parameter.device
                    and value.numel()
                ):
                    tensors.append(value)
    return tensors
