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

What the stages do differently with a bucket, and what a worker owns of the gradients afterwards, is one
object per stage (``stages``); this mode lays out the slices, runs the reducers, checkpoints and commits.

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

from hvd_plugins.core.checkpoint.dcp_read import saved_names
from hvd_plugins.core.checkpoint.dcp_source import DcpSource
from hvd_plugins.core.comm.compression import Compressor
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.reducer import BucketReducer
from hvd_plugins.core.comm.shards import LocalShard
from hvd_plugins.core.comm.topology import NodeGroups, discover_topology
from hvd_plugins.core.comm.world import spans_nodes, world_group, world_size
from hvd_plugins.core.sync.base import OWN_PARTS_KEY, GradientSync
from hvd_plugins.core.sync.parts import is_part
from hvd_plugins.core.sync.sharded.optimizer import ShardedOptimizer, refuse_whole_tensor_optimizer
from hvd_plugins.core.sync.sharded.replicas import (
    commit_state,
    holder_ring,
    is_commit,
    rebuild,
    replicate,
    to_bytes,
    whole_state,
    whole_values,
)
from hvd_plugins.core.sync.sharded.stages import SHARD_STAGES, ParameterStage, ShardRoute, ShardStage
from hvd_plugins.core.sync.sharded.units import UnitPolicy


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
        auto_wrap_policy: UnitPolicy = None,
        reshard_after_forward: bool = True,
        device: torch.device | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        if shard not in SHARD_STAGES:
            raise ValueError(f"shard={shard!r} is not a sharded mode; choose one of {list(SHARD_STAGES)}")
        if op not in ("average", "sum"):
            raise ValueError(f"op={op!r} is not supported with shard={shard!r}; choose 'average' or 'sum'")
        self.shard = shard
        self.counters = counters
        self.bucket_bytes = bucket_bytes
        self.checkpoint = checkpoint
        size = world_size()
        self.workers = size
        self.nodes: NodeGroups | None = None
        """With sharding inside the node: the node groups (each node holds all of the state, split over its workers)."""
        if node_groups is not None and node_groups.local is not None and node_groups.cross is not None:
            self.nodes, self.topology = node_groups, node_groups.topology
            self.world = node_groups.local  # the workers a bucket is split over
            scope = Scope.NODE_LOCAL
        else:
            self.world = world_group()
            scope = Scope.CROSS_NODE if spans_nodes() else Scope.NODE_LOCAL
        route = ShardRoute(
            self.world,
            self.nodes,
            compressor,
            compress_node_local,
            counters,
            scope,
            op,
            size,
            bucket_bytes,
            device or torch.device("cpu"),
        )
        stage = SHARD_STAGES[shard]
        self.stage: ShardStage = stage.build(route, auto_wrap_policy, reshard_after_forward, param_dtype)
        self.copies = size // self.world.size
        """How many workers hold each slice (the number of nodes when sharded inside the node, else 1)."""
        self._committing = False
        self._ring: tuple[int, ...] | None = None  # who keeps whose copy in a commit, learned at the first
        self._optimizers: dict[int, ShardedOptimizer] = {}
        self._reducers: dict[int, BucketReducer] = {}
        self._synchronized: dict[int, int] = {}
        """Each optimizer's ``generation`` when its gradients were last averaged (by id)."""

    # ------------------------------------------------------------------ wrapping
    def setup(self, model: Module, optimizers: Sequence[Optimizer], total_epochs: int | None) -> None:
        """Shard ``model`` for ``optimizers``. With ``shard="parameters"`` a model is sharded without an optimizer
        too (``trainer.validate``, ``predict``, a Fabric loop that only evaluates): the units then keep slices that
        nothing steps; an optimizer set up later takes them over, with every other optimizer set up so far."""
        refuse_sparse_gradients(model, self.shard)
        sharded = [self._sharded(optimizer) for optimizer in optimizers]
        if self.shard == "parameters":
            given = {id(each) for each in sharded}
            sharded = [each for each in self._optimizers.values() if id(each) not in given] + sharded
        self.stage.attach(model, sharded, self._relay)

    def _unshard_for(self) -> None:
        """Before an optimizer is laid out over a model already sharded (set up alone, or for another optimizer):
        ``setup`` lays the units out again for every optimizer, a unit at a time (``ParameterStage._reattach``). Only
        where parameters were frozen or unfrozen since is the model made whole again first (a collective) and
        sharded anew."""
        if not (isinstance(self.stage, ParameterStage) and self.stage.can_reattach()):
            self.stage.detach()

    def _relay(self, sharded: ShardedOptimizer) -> None:
        """Lay ``sharded``'s slices out anew, keeping its state (a collective), and rebuild its reducer."""
        sharded.repartition(lambda signature: self.stage.lay_out(sharded, signature))
        self._build_reducer(sharded)

    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        refuse_whole_tensor_optimizer(optimizer, self.shard)
        if self.shard == "parameters":
            self._unshard_for()
        name = f"shard.opt{len(self._optimizers)}"
        buckets = self.stage.lay_out(optimizer)
        sharded = ShardedOptimizer(
            optimizer,
            buckets,
            self.world,
            self.counters,
            self.stage.route.scope,
            name,
            gradients_from_parameters=self.stage.gradients_from_parameters,
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
            self.stage.bucket_operation(sharded),
            f"{sharded.name}.grad",
            self.backward_passes,
            buckets=[bucket.parameters for bucket in buckets],
            land_early=self.stage.land_early,
            max_in_flight=self.stage.max_in_flight,
            counters=self.counters,
        )
        reducer.armed = self.stage.armed()
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
        with self.stage.whole_parameters():
            self._relay(sharded)

    def _reducer(self, optimizer: Optimizer) -> BucketReducer:
        reducer = self._reducers.get(id(optimizer))
        if reducer is None:
            raise ValueError(f"shard={self.shard!r}: {type(optimizer).__name__} was not set up by this strategy")
        return reducer

    # ------------------------------------------------------------------ averaging
    def synchronize(self, optimizer: Optimizer) -> None:
        """Average the gradients of the backward passes since the last step, once: a second call before the step
        (the step's own, after the shards' gradients were shown right after backward) finds them averaged."""
        reducer = self._reducer(optimizer)
        if self._averaged(optimizer):
            return
        reducer.finish(waiting=self.counters.waiting())
        reducer.armed = self.stage.armed()
        self.stage.after_backward()
        self._synchronized[id(optimizer)] = self._sharded(optimizer).generation

    @contextlib.contextmanager
    def deferred(self, optimizer: Optimizer) -> Iterator[None]:
        """Around the strategy's step: once it ran (or a GradScaler skipped it), the next backward's are new."""
        try:
            yield
        finally:
            self._synchronized.pop(id(optimizer), None)

    def _averaged(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were averaged and it has neither stepped nor zeroed them since."""
        return self._synchronized.get(id(optimizer)) == self._sharded(optimizer).generation

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
        if reducer is None:
            return
        averaged = self._averaged(optimizer)  # averaged right after backward, not stepped yet
        if not reducer.in_flight and not averaged:
            self._follow_trainable(self._sharded(optimizer))
        else:
            raise ValueError(
                f"shard={self.shard!r} cannot accumulate gradients with a second backward before the optimizer "
                "step once the first one's gradients are being averaged: accumulate with accumulate_grad_batches (the "
                "Trainer) or fabric.no_backward_sync (Fabric), or use shard='none'."
            )

    def started(self, optimizer: Optimizer) -> bool:
        reducer = self._reducers.get(id(optimizer))
        return reducer is not None and reducer.in_flight

    # ------------------------------------------------------------------ what this worker owns
    def owned_gradients(self, optimizer: Optimizer) -> list[torch.Tensor]:
        return self.stage.owned_gradients(self._sharded(optimizer))

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        return self.stage.clip_grad_norm_(self._sharded(optimizer), max_norm, norm_type, error_if_nonfinite)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        self.stage.clip_grad_value_(self._sharded(optimizer), clip_value)

    def refuse_grad_scaler(self, grad_scaler: object | None) -> None:
        self.stage.refuse_grad_scaler(grad_scaler)

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

    def optimizer_pieces(self, optimizer: Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
        """This worker's slices of the state, by parameter name, as a DCP checkpoint saves them (no collective)."""
        return self._sharded(optimizer).pieces(names)

    def model_pieces(self, model: Module) -> dict[str, Any]:
        return self.stage.model_pieces(model)

    def load_optimizer_pieces(self, optimizer: Optimizer, model: Module, source: DcpSource) -> None:
        """Only this worker's slices of the state read from the checkpoint (``ShardedOptimizer.load_pieces``)."""
        self._sharded(optimizer).load_pieces(saved_names(model), source)

    def _commit_parts(self, sharded: ShardedOptimizer) -> dict[str, Any]:
        part = sharded.part(with_values=True)  # a unit's slices are its only copy (``shard="parameters"``)
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
            parts = rebuild(state[OWN_PARTS_KEY], state["workers"], f"{sharded.name}.rebuild")
            sharded.load_state_dict(whole_state(state, parts))
            sharded.load_values(whole_values(parts))
        elif is_part(state):
            sharded.load_part(state)
        else:
            sharded.load_state_dict(state)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this worker holds, over all its optimizers."""
        return sum(sharded.state_bytes() for sharded in self._optimizers.values())

    def model_state_dict(self, model: Module) -> dict[str, Any]:
        return self.stage.model_state_dict(model, committing=self._committing)

    def load_model_state_dict(self, model: Module, state: Mapping[str, Any], strict: bool = True) -> None:
        self.stage.load_model_state_dict(model, state, strict)

    def whole_numel(self, parameter: torch.nn.Parameter) -> int:
        return self.stage.whole_shape(parameter).numel()

    def local_shards(self) -> dict[str, LocalShard]:
        if not isinstance(self.stage, ParameterStage):
            return super().local_shards()  # ZeRO-1/2: the parameters stay whole
        return self.stage.local_shards()

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        self.stage.detach()
        self._drop_reducers()

    def abandon(self, optimizers: Sequence[Optimizer]) -> None:
        """After an elastic reset: the units' parameters left as placeholders, nothing gathered."""
        self.stage.abandon()
        self._drop_reducers()

    def _drop_reducers(self) -> None:
        for reducer in self._reducers.values():
            reducer.remove()
        self._reducers.clear()
        self._optimizers.clear()


def refuse_sparse_gradients(model: Module, shard: str) -> None:
    """Sparse gradients (``nn.Embedding(sparse=True)``) have no slices: sharding would send them dense. Say so."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"shard={shard!r} cannot shard sparse gradients: {name or 'the model'} is "
                f"{type(module).__name__}(sparse=True). Use sparse=False, or shard='none'."
            )
