"""``shard="optimizer"`` (ZeRO-1) and ``shard="gradients"`` (ZeRO-2), over every worker or inside each node.

Every worker holds the whole model; the optimizer state is split over the workers
(``ShardedOptimizer``). With ``shard="optimizer"`` gradients are averaged as a flat allreduce would
(each bucket summed over every worker as backward completes it) and each worker steps its slices of
them. With ``shard="gradients"`` each bucket is reduce-scattered from backward's hooks instead: a
worker receives only its slice of the averaged gradient and the whole gradients are freed, so after
the step it holds 1/N of them. Either way the updated slices are allgathered after the step. The
bytes are those of an allreduce: a ring allreduce is a reduce-scatter and an allgather.

The reduce-scatter is a global alltoall that sends each worker its piece of the padded bucket
(``comm.partners``): one round, every Horovod build, summed in rank order on every worker.

Inside the node (``sync="hierarchical"``, the layout FSDP calls hybrid sharding): the state is
split over the L workers of each node and every node holds all of it. A bucket is reduce-scattered
inside the node, each shard is summed across nodes among the workers of the same local rank (the
two-level allreduce's first two legs), the shard is stepped and the parameters are allgathered
inside the node: 1/L of the state per worker, and the cross-node bytes of the two-level allreduce.
ZeRO-1 takes the two-level allreduce's three legs and steps its slices of the whole averaged gradients.

In an elastic commit each worker keeps its own part and a copy of another's (``replicas``), or its
own part only where other nodes hold copies of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.comm.compression import Compressor, NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.in_flight import InFlight, Then
from hvd_plugins.core.comm.partners import GroupSum, add_in_order, start_reduce_scatter
from hvd_plugins.core.comm.reducer import BucketOperation, BucketReducer
from hvd_plugins.core.comm.topology import NodeGroups, discover_topology
from hvd_plugins.core.comm.two_level import TwoLevelSum
from hvd_plugins.core.comm.world import max_over_world, spans_nodes, sum_over_world, world_group, world_size
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.sync.sharded.checkpoint import is_part
from hvd_plugins.core.sync.sharded.optimizer import ShardedOptimizer, refuse_whole_tensor_optimizer
from hvd_plugins.core.sync.sharded.partition import partition
from hvd_plugins.core.sync.sharded.replicas import (
    commit_state,
    holder_ring,
    is_commit,
    rebuild,
    replicate,
    to_bytes,
    whole_state,
)

SHARD_STAGES = {"optimizer": 1, "gradients": 2}
BUCKETS_IN_FLIGHT = 2
"""ZeRO-2: buckets reduce-scattered at once; a third lands the oldest first. Each bucket in flight holds about
2.5 copies of itself (its flat gradients, the pieces it sends, the pieces it receives), so an unbounded backward
would hold them for the whole model and spend what the freed gradients saved."""
"""``shard=`` names and the ZeRO stage each stands for."""


class ShardedGradientSync(GradientSync):
    """Averages gradients for a ``ShardedOptimizer`` (ZeRO-1) or hands it its slices of them (ZeRO-2)."""

    world_shaped = True  # the slices are the old world's
    replicates_optimizer_state = False

    def __init__(
        self,
        shard: str,
        compressor: Compressor,
        op: str,
        counters: CommCounters,
        bucket_bytes: int,
        checkpoint: str = "full",
        node_groups: NodeGroups | None = None,
        compress_node_local: bool = False,
    ) -> None:
        if shard not in SHARD_STAGES:
            raise ValueError(f"shard={shard!r} is not a sharded mode; choose one of {list(SHARD_STAGES)}")
        if op not in ("average", "sum"):
            raise ValueError(f"op={op!r} is not supported with shard={shard!r}; choose 'average' or 'sum'")
        self.shard = shard
        self.stage = SHARD_STAGES[shard]
        self.compressor = compressor
        self.op = op
        self.counters = counters
        self.bucket_bytes = bucket_bytes
        self.checkpoint = checkpoint
        self.compress_node_local = compress_node_local
        size = world_size()
        self.workers = size
        self.nodes: NodeGroups | None = None
        """With sharding inside the node: the node groups (each node holds all of the state, split over its workers)."""
        if node_groups is not None and node_groups.local is not None and node_groups.cross is not None:
            self.nodes, self.topology = node_groups, node_groups.topology
            self.world = node_groups.local  # the workers a bucket is split over
            self.scope = Scope.NODE_LOCAL
        else:
            self.world = world_group()
            self.scope = Scope.CROSS_NODE if spans_nodes() else Scope.NODE_LOCAL
        self.copies = size // self.world.size
        """How many workers hold each slice (the number of nodes when sharded inside the node, else 1)."""
        self._committing = False
        self._ring: tuple[int, ...] | None = None  # who keeps whose copy in a commit, learned at the first
        self._optimizers: dict[int, ShardedOptimizer] = {}
        self._reducers: dict[int, BucketReducer] = {}

    # ------------------------------------------------------------------ wrapping
    def setup(self, model: Module, optimizers: Sequence[Optimizer], total_epochs: int | None) -> None:
        refuse_sparse_gradients(model, self.shard)

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        refuse_whole_tensor_optimizer(optimizer, self.shard)
        name = f"shard.opt{len(self._optimizers)}"
        buckets = partition(optimizer, self.world.size, self.world.index, self.bucket_bytes)
        sharded = ShardedOptimizer(
            optimizer, buckets, self.world, self.counters, self.scope, name, gradients_from_parameters=self.stage == 1
        )
        self._optimizers[id(sharded)] = sharded
        self._build_reducer(sharded)
        return sharded

    def _build_reducer(self, sharded: ShardedOptimizer) -> None:
        """The reducer that runs this mode's operation on the sharded optimizer's buckets, from backward's hooks."""
        if (old := self._reducers.get(id(sharded))) is not None:
            old.remove()
        buckets = sharded.buckets
        reducer = BucketReducer(
            [p for bucket in buckets for p in bucket.parameters],
            self.bucket_bytes,
            self._scatter_to(sharded) if self.stage == 2 else self._sum_bucket,
            f"{sharded.name}.grad",
            self.backward_passes,
            buckets=[bucket.parameters for bucket in buckets],
            land_early=self.stage == 2,  # its results go to the slices, which nothing reads before the step
            max_in_flight=BUCKETS_IN_FLIGHT if self.stage == 2 else None,
        )
        reducer.armed = self.workers > 1 or self.stage == 2
        self._reducers[id(sharded)] = reducer

    def _follow_trainable(self, sharded: ShardedOptimizer) -> None:
        """Parameters frozen or unfrozen since the slices were laid out: lay them out again (every worker
        reaches this before the same backward, so the collective inside is safe). An optimizer whose
        parameters are all frozen keeps its layout: Lightning's ``toggle_optimizer`` freezes the others'
        parameters while one optimizer steps, and they train again unchanged."""
        planned = [p for bucket in sharded.buckets for p in bucket.parameters]
        trainable = [p for group in sharded.param_groups for p in group["params"] if p.requires_grad]
        if {id(p) for p in planned} == {id(p) for p in trainable} or not trainable:
            return  # unchanged, or all frozen for now (Lightning's toggle_optimizer while another one steps)
        world, bucket_bytes = self.world, self.bucket_bytes
        sharded.repartition(lambda signature: partition(sharded, world.size, world.index, bucket_bytes, signature))
        self._build_reducer(sharded)

    def _reducer(self, optimizer: Optimizer) -> BucketReducer:
        reducer = self._reducers.get(id(optimizer))
        if reducer is None:
            raise ValueError(f"shard={self.shard!r}: {type(optimizer).__name__} was not set up by this strategy")
        return reducer

    # ------------------------------------------------------------------ averaging
    def synchronize(self, optimizer: Optimizer) -> None:
        reducer = self._reducer(optimizer)
        reducer.finish(waiting=self.counters.waiting())
        reducer.armed = self.workers > 1 or self.stage == 2

    def _sum_bucket(self, index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
        """ZeRO-1: one bucket summed over every worker (Horovod's allreduce, or the two-level allreduce when sharded
        inside the node), averaged, written back."""
        if self.workers == 1:
            return None
        if self.nodes is not None:
            sum_: InFlight[torch.Tensor] = self._two_level(flat, name, keep_shard=False)
        else:
            sum_ = GroupSum(flat, self.world, self.compressor, name)
            if sum_.nbytes:
                self.counters.record(self.scope, sum_.nbytes)
        count = flat.numel()
        return Then(sum_, lambda total: total[:count] if self.op == "sum" else total[:count].div_(self.workers))

    def _scatter_to(self, sharded: ShardedOptimizer) -> BucketOperation:
        """ZeRO-2: each bucket reduce-scattered; this worker's slice of the average becomes its slice's gradient
        and the whole gradients of the bucket are freed."""

        def scatter(index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
            bucket, piece = sharded.buckets[index], sharded.slices[index]
            padded = bucket.layout.padded(flat)
            for parameter in bucket.parameters:
                parameter.grad = None  # the flat copy travels; the whole gradients go at once

            def land(total: torch.Tensor) -> None:
                if self.op == "average" and self.workers > 1:
                    total = total.div_(self.workers)
                piece.grad = total.to(piece.dtype) if piece.grad is None else piece.grad.copy_(total)
                return None

            if self.workers == 1:
                return Then(_Done(padded), land)
            if self.nodes is not None:  # inside the node, then this shard across nodes
                return Then(self._two_level(padded, name, keep_shard=True), land)
            pending = start_reduce_scatter(padded, self.world, self.compressor, name)
            self.counters.record(self.scope, pending.piece_nbytes * self.world.size)
            return Then(pending, lambda pieces: land(add_in_order(pieces)))

        return scatter

    def _two_level(self, flat: torch.Tensor, name: str, keep_shard: bool) -> TwoLevelSum:
        """The two-level allreduce's legs over the node groups (its first two only, with ``keep_shard``)."""
        assert self.nodes is not None
        local_codec = self.compressor if self.compress_node_local else NoCompression()
        return TwoLevelSum(flat, self.nodes, local_codec, self.compressor, self.counters, name, keep_shard)

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        self.backward_passes = passes
        if (reducer := self._reducers.get(id(optimizer))) is not None:
            reducer.set_backward_passes(passes)

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        if (reducer := self._reducers.get(id(optimizer))) is not None:
            reducer.hold_next_backward()

    def before_backward(self, optimizer: Optimizer) -> None:
        """Follow parameters (un)frozen since the last step; refuse a second backward while buckets travel."""
        reducer = self._reducers.get(id(optimizer))
        if reducer is not None and not reducer.in_flight:
            self._follow_trainable(self._sharded(optimizer))
        elif reducer is not None:
            raise ValueError(
                f"shard={self.shard!r} cannot accumulate gradients with a second backward before the optimizer "
                "step while the first one's buckets are on their way: accumulate with accumulate_grad_batches (the "
                "Trainer) or fabric.no_backward_sync (Fabric), or use shard='none'."
            )

    # ------------------------------------------------------------------ what this worker owns
    def owned_gradients(self, optimizer: Optimizer) -> list[torch.Tensor]:
        if self.stage == 1:
            return super().owned_gradients(optimizer)
        return self._sharded(optimizer).owned_gradients()

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """ZeRO-2: the norm of the whole averaged gradient from this worker's slices, in one collective."""
        if self.stage == 1:
            return super().clip_grad_norm_(optimizer, max_norm, norm_type, error_if_nonfinite)
        gradients = self._sharded(optimizer).owned_gradients()
        total = global_norm(gradients, float(norm_type), self.workers, self.copies)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for gradient in gradients:
            gradient.mul_(scale.to(gradient.device, gradient.dtype))
        return total

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        if self.stage == 1:
            return super().clip_grad_value_(optimizer, clip_value)
        for gradient in self._sharded(optimizer).owned_gradients():
            gradient.clamp_(-clip_value, clip_value)
        return None

    def refuse_grad_scaler(self, grad_scaler: object | None) -> None:
        """ZeRO-2 frees the whole gradients a GradScaler unscales and checks for inf/NaN: refuse it, before training."""
        if grad_scaler is not None and self.stage == 2:
            raise ValueError(
                "shard='gradients' cannot train with a GradScaler (precision='16-mixed'): the scaler unscales and "
                "checks the whole gradients, which ZeRO-2 frees once their slices are reduce-scattered. Use "
                "precision='bf16-mixed' (no scaler), or shard='optimizer', which keeps the whole averaged gradients."
            )

    def _sharded(self, optimizer: Optimizer) -> ShardedOptimizer:
        """The sharded optimizer ``optimizer`` is (also after a fit, when a checkpoint is saved from it)."""
        sharded = optimizer if isinstance(optimizer, ShardedOptimizer) else self._optimizers.get(id(optimizer))
        if sharded is None:
            raise ValueError(f"shard={self.shard!r}: {type(optimizer).__name__} was not set up by this strategy")
        return sharded

    def optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole state (a collective of every worker), or with ``shard_checkpoint="parts"`` this worker's part;
        in an elastic commit the parts this worker keeps (``replicas``)."""
        sharded = self._sharded(optimizer)
        if self._committing:
            return self._commit_parts(sharded)
        if self.checkpoint != "parts":
            return sharded.state_dict()
        part = sharded.part()
        if self.nodes is not None:
            part["copy"] = self.nodes.topology.node_index  # every node holds the same parts: node 0's are written
        return part

    def _commit_parts(self, sharded: ShardedOptimizer) -> dict[str, Any]:
        part = sharded.part()
        if self.copies > 1:  # the other nodes hold this part too
            return commit_state({self.world.index: to_bytes(part)}, self.world.size, part["param_groups"])
        if self._ring is None:
            self._ring = holder_ring(discover_topology())  # a collective: every worker commits at the same step
        held = replicate(part, self._ring, f"{sharded.name}.commit")
        return commit_state(held, self.world.size, part["param_groups"])

    @contextlib.contextmanager
    def committing(self) -> Iterator[None]:
        self._committing = True
        try:
            yield
        finally:
            self._committing = False

    def load_optimizer_state_dict(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        """A whole state (saved at any world size), this worker's own part, or an elastic commit's parts (a
        collective: the survivors' parts are laid out again over this world)."""
        sharded = self._sharded(optimizer)
        if is_commit(state):
            parts = rebuild(state["held"], state["workers"], f"{sharded.name}.rebuild")
            sharded.load_state_dict(whole_state(state, parts))
        elif is_part(state):
            sharded.load_part(state)
        else:
            sharded.load_state_dict(state)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this worker holds, over all its optimizers."""
        return sum(sharded.state_bytes() for sharded in self._optimizers.values())

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        for reducer in self._reducers.values():
            reducer.remove()
        self._reducers.clear()
        self._optimizers.clear()


class _Done(InFlight[torch.Tensor]):
    """A result that needs no collective (a job of one worker)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def progress(self) -> None:
        """Nothing in flight."""

    def ready(self) -> bool:
        return True

    def wait(self, meanwhile: object = None) -> torch.Tensor:
        return self.value


def global_norm(gradients: Sequence[torch.Tensor], norm_type: float, workers: int, copies: int = 1) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients of every worker together, from this worker's ``gradients``:
    the local sum of powers (or maximum) combined across workers in one allreduce. Each slice is held by
    ``copies`` workers (one per node when sharded inside the node): its powers count once."""
    device = gradients[0].device if gradients else torch.device("cpu")
    if norm_type == float("inf"):
        local = max((g.detach().abs().max() for g in gradients), default=torch.zeros((), device=device))
        local = local.float().reshape(1).cpu()
        combined = max_over_world(local, "shard.grad_norm") if workers > 1 else local
        return combined[0].to(device)
    powers = torch.zeros((), dtype=torch.float64)
    for gradient in gradients:
        powers += gradient.detach().double().abs().pow(norm_type).sum().cpu()
    local = powers.reshape(1)
    combined = sum_over_world(local, "shard.grad_norm") if workers > 1 else local
    return (combined[0] / copies).pow(1.0 / norm_type).float().to(device)


def refuse_sparse_gradients(model: Module, shard: str) -> None:
    """Sparse gradients (``nn.Embedding(sparse=True)``) have no slices: sharding would send them dense. Say so."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"shard={shard!r} cannot shard sparse gradients: {name or 'the model'} is "
                f"{type(module).__name__}(sparse=True). Use sparse=False, or shard='none'."
            )
