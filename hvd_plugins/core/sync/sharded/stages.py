"""What each ZeRO stage does with a bucket of gradients, and what a worker owns of them afterwards.

One object per stage, so that the sharded mode never asks which stage runs: it lays out the slices, keeps
the reducers, checkpoints and commits, and hands each bucket to its stage.

- ``OptimizerStage`` (``shard="optimizer"``, ZeRO-1): every bucket summed over every worker as a flat
  allreduce would; every worker holds the whole averaged gradients and steps its slices of them.
- ``GradientStage`` (``shard="gradients"``, ZeRO-2): every bucket reduce-scattered from backward's hooks;
  a worker receives its slice of the average and the whole gradients are freed.
- ``ParameterStage`` (``shard="parameters"``, ZeRO-3): as ZeRO-2, with the buckets laid out per unit of the
  model, whose parameters exist whole only while the unit computes (``units``).

Both move their bytes along a ``ShardRoute``: over every worker, or inside the node and then across
nodes among the workers of one local rank (sharded inside the node).
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from hvd_plugins.core.comm.compression import Compressor, NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.in_flight import InFlight, Meanwhile, Then
from hvd_plugins.core.comm.parameters import optimizer_parameters
from hvd_plugins.core.comm.partners import GroupSum, PartnerGroup, add_in_order, start_reduce_scatter
from hvd_plugins.core.comm.reducer import BucketOperation, KeepsBuckets
from hvd_plugins.core.comm.shards import LocalShard
from hvd_plugins.core.comm.topology import NodeGroups
from hvd_plugins.core.comm.two_level import TwoLevelSum
from hvd_plugins.core.comm.world import broadcast_from_root, max_over_world, sum_over_world, world_rank
from hvd_plugins.core.comm.world_sum import WorldSumInPlace
from hvd_plugins.core.config import describe_policy
from hvd_plugins.core.sync.meta import materialize, real_tensors
from hvd_plugins.core.sync.sharded.optimizer import ShardedOptimizer
from hvd_plugins.core.sync.sharded.partition import (
    ShardedBucket,
    Signature,
    partition,
    partition_by_units,
    trainable_groups,
)
from hvd_plugins.core.sync.sharded.shard_gradients import ShardedNorms
from hvd_plugins.core.sync.sharded.slices import BucketSlices, unstepped_slices
from hvd_plugins.core.sync.sharded.unit_state import UnitStates, parameter_names
from hvd_plugins.core.sync.sharded.units import (
    ShardedUnits,
    Unit,
    UnitPolicy,
    describe_units,
    find_units,
    norms_in_units,
    outside_units,
    unit_owners,
)

log = logging.getLogger(__name__)

BUCKETS_IN_FLIGHT = 2
"""ZeRO-2: buckets reduce-scattered at once; a third lands the oldest first. Each bucket in flight holds about
2.5 copies of itself (its flat gradients, the pieces it sends, the pieces it receives), so an unbounded backward
would hold them for the whole model and spend what the freed gradients saved."""


@dataclass(frozen=True)
class ShardRoute:
    """Where a sharded mode's buckets travel: over ``world`` (every worker; or, with ``nodes``, the workers of
    this node, each slice then summed across nodes), compressed by ``compressor``, counted under ``scope``."""

    world: PartnerGroup
    nodes: NodeGroups | None
    compressor: Compressor
    compress_node_local: bool
    counters: CommCounters
    scope: Scope
    op: str  # "average" or "sum"
    workers: int  # every worker of the job
    bucket_bytes: int  # buckets of the parameters no unit owns
    device: torch.device = torch.device("cpu")  # where this worker's tensors live: a meta model is made real there

    def two_level(self, flat: torch.Tensor, name: str, keep_shard: bool) -> TwoLevelSum:
        """The two-level allreduce's legs over the node groups (its first two only, with ``keep_shard``)."""
        assert self.nodes is not None
        local_codec = self.compressor if self.compress_node_local else NoCompression()
        return TwoLevelSum(flat, self.nodes, local_codec, self.compressor, self.counters, name, keep_shard)

    def averaged(self, total: torch.Tensor) -> torch.Tensor:
        """A sum over every worker made what ``op`` asks for, in place."""
        return total.div_(self.workers) if self.op == "average" and self.workers > 1 else total


class ShardStage(ABC):
    """One ZeRO stage: the operation that runs on each bucket from backward's hooks, and what this worker owns."""

    shard: str
    """The ``shard=`` value this stage stands for."""
    land_early = False
    """Whether a bucket's result may land while backward runs (its results go where nothing reads before the step)."""
    max_in_flight: int | None = None
    """How many buckets may travel at once (None: all of them)."""
    gradients_from_parameters = True
    """Whether each slice's gradient is taken from the whole averaged gradients (else the stage writes it)."""

    def __init__(self, route: ShardRoute) -> None:
        self.route = route

    @classmethod
    def build(
        cls, route: ShardRoute, policy: UnitPolicy, reshard_after_forward: bool, param_dtype: torch.dtype | None
    ) -> ShardStage:
        """The stage for ``route``; the unit settings matter to ``shard="parameters"`` only."""
        return cls(route)

    @abstractmethod
    def bucket_operation(self, sharded: ShardedOptimizer) -> BucketOperation:
        """What runs on each of ``sharded``'s buckets once backward has filled it."""

    def lay_out(self, optimizer: Optimizer, signature: Signature | None = None) -> list[ShardedBucket]:
        """The buckets of ``optimizer``'s trainable parameters, split over the route's workers."""
        world = self.route.world
        return partition(optimizer, world.size, world.index, self.route.bucket_bytes, signature)

    def attach(
        self, model: Module, optimizers: Sequence[ShardedOptimizer], relay: Callable[[ShardedOptimizer], None]
    ) -> None:
        """Once the optimizers are wrapped and the model is known (a stage that splits the model's parameters
        lays the optimizers out again with ``relay`` and takes the parameters then)."""
        return None

    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[None]:
        """Inside, every parameter is whole and unhooked (to lay the slices out anew)."""
        yield

    def after_backward(self) -> None:
        """After the step's last backward and its sync."""
        return None

    def detach(self) -> None:
        """At a fit's end: the model as the user gave it (whole), no hook left."""
        return None

    def abandon(self) -> None:
        """After an elastic reset: as ``detach``, but no collective may run (the old world is gone)."""
        self.detach()

    def model_state_dict(self, model: Module, committing: bool = False) -> dict[str, Any]:
        """The model's state for a checkpoint, or, ``committing``, for an elastic commit."""
        return model.state_dict()

    def load_model_state_dict(self, model: Module, state: Mapping[str, Any], strict: bool) -> None:
        model.load_state_dict(state, strict=strict)

    def model_pieces(self, model: Module) -> dict[str, Any]:
        """The model's state as a DCP checkpoint saves it (ZeRO-1/2: every worker holds it whole)."""
        return model.state_dict()

    def whole_shape(self, parameter: Parameter) -> torch.Size:
        """``parameter``'s shape in the whole model (ZeRO-1/2: the shape it has)."""
        return parameter.shape

    def armed(self) -> bool:
        """Whether backward's hooks start the buckets (no collective is needed in a job of one worker)."""
        return self.route.workers > 1

    def owned_gradients(self, sharded: ShardedOptimizer) -> list[torch.Tensor]:
        """The averaged gradients this worker owns after the sync: every parameter's whole gradient."""
        return [p.grad for p in optimizer_parameters(sharded) if p.grad is not None]

    def clip_grad_norm_(
        self, sharded: ShardedOptimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """Clip by the norm over the whole model; every worker holds every averaged gradient: no collective."""
        return torch.nn.utils.clip_grad_norm_(
            optimizer_parameters(sharded), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def clip_grad_value_(self, sharded: ShardedOptimizer, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(optimizer_parameters(sharded), clip_value)

    def refuse_grad_scaler(self, grad_scaler: object | None) -> None:
        """Before the first step: raise if this stage cannot train under a ``16-mixed`` GradScaler (a stage that
        keeps the whole averaged gradients can: the scaler unscales and checks them)."""
        return None


class OptimizerStage(ShardStage):
    """ZeRO-1: each bucket summed over every worker (Horovod's allreduce, or the two-level allreduce when sharded
    inside the node), averaged and written back into the whole gradients."""

    shard = "optimizer"

    def bucket_operation(self, sharded: ShardedOptimizer) -> BucketOperation:
        return self._sum_bucket

    def _sum_bucket(self, index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
        route = self.route
        if route.workers == 1:
            return None
        if route.nodes is not None:
            sum_: InFlight[torch.Tensor] = route.two_level(flat, name, keep_shard=False)
        elif isinstance(route.compressor, NoCompression) and route.world.size == route.workers:
            divide_by = route.workers if route.op == "average" else None
            return WorldSumInPlace(flat, name, route.counters, route.scope, divide_by)  # where the gradients lie
        else:
            sum_ = GroupSum(flat, route.world, route.compressor, name)
            if sum_.nbytes:
                route.counters.record(route.scope, sum_.nbytes)
        count = flat.numel()
        return Then(sum_, lambda total: route.averaged(total[:count]))


class GradientStage(ShardStage):
    """ZeRO-2: each bucket reduce-scattered; this worker's slice of the average becomes its slice's gradient and
    the whole gradients of the bucket are freed."""

    shard = "gradients"
    land_early = True
    max_in_flight = BUCKETS_IN_FLIGHT
    gradients_from_parameters = False

    def armed(self) -> bool:
        return True  # even alone: the slice's gradient is written by the bucket's operation

    def bucket_operation(self, sharded: ShardedOptimizer) -> BucketOperation:
        route = self.route

        def scatter(index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
            bucket, piece = sharded.buckets[index], sharded.slices[index]
            padded = bucket.layout.padded(flat.to(piece.dtype))  # gradients of a unit gathered in half: as the slice
            for parameter in bucket.parameters:
                parameter.grad = None  # the flat copy travels; the whole gradients go at once

            def land(total: torch.Tensor) -> None:
                total = route.averaged(total)
                piece.grad = total.to(piece.dtype) if piece.grad is None else piece.grad.copy_(total)
                return None

            if route.workers == 1:
                return Then(_Done(padded), land)
            if route.nodes is not None:  # inside the node, then this shard across nodes
                return Then(route.two_level(padded, name, keep_shard=True), land)
            pending = start_reduce_scatter(padded, route.world, route.compressor, name)
            route.counters.record(route.scope, pending.piece_nbytes * route.world.size)
            return Then(pending, lambda pieces: land(add_in_order(pieces)))

        return KeepsBuckets(scatter, [bucket.flat for bucket in sharded.buckets])

    def owned_gradients(self, sharded: ShardedOptimizer) -> list[torch.Tensor]:
        return sharded.owned_gradients()

    def clip_grad_norm_(
        self, sharded: ShardedOptimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """The norm of the whole averaged gradient from this worker's slices, in one collective."""
        gradients = sharded.owned_gradients()
        copies = self.route.workers // self.route.world.size
        total = global_norm(gradients, float(norm_type), self.route.workers, copies)
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

    def clip_grad_value_(self, sharded: ShardedOptimizer, clip_value: float) -> None:
        for gradient in sharded.owned_gradients():
            gradient.clamp_(-clip_value, clip_value)

    def refuse_grad_scaler(self, grad_scaler: object | None) -> None:
        """The whole gradients a GradScaler unscales and checks for inf/NaN are freed here: refuse it."""
        if grad_scaler is not None:
            raise ValueError(
                "shard='gradients' cannot train with a GradScaler (precision='16-mixed'): the scaler unscales and "
                "checks the whole gradients, which ZeRO-2 frees once their slices are reduce-scattered. Use "
                "precision='bf16-mixed' (no scaler), or shard='optimizer', which keeps the whole averaged gradients."
            )


class ParameterStage(GradientStage):
    """ZeRO-3: the gradients as ZeRO-2, laid out per unit of the model, whose parameters the slices alone hold
    between the unit's computations (``units``)."""

    shard = "parameters"

    def __init__(
        self,
        route: ShardRoute,
        policy: UnitPolicy = None,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(route)
        self.policy, self.reshard_after_forward = policy, reshard_after_forward
        self.param_dtype = param_dtype
        """The dtype units are gathered in to compute (half the bytes under ``bf16-mixed``); None: the slices'."""
        self._model: Module | None = None
        self._owners: dict[int, int] | None = None  # parameter id -> unit, once attached
        self._names: list[tuple[str, Module]] = []
        self._optimizers: list[ShardedOptimizer] = []
        self._unstepped: BucketSlices | None = None
        """The slices of the units' parameters that no optimizer steps: frozen ones, and all of them while no
        optimizer is set up (``_hold_unstepped``)."""
        self._held_frozen: set[int] = set()  # the parameters frozen when ``_unstepped`` was laid out, by id
        self._units: ShardedUnits | None = None
        self._triggers: list[Module] = []  # the modules whose forward gathers the model's own unit
        self._state = UnitStates(lambda: self._units)
        """The model's state dict as whole tensors, an elastic commit's slices, ``local_shards()``."""
        self._norms = ShardedNorms()
        self._shapes: dict[int, torch.Size] = {}
        """Each parameter's whole shape by id, taken when the model was sharded (it then holds its shard)."""

    @classmethod
    def build(
        cls, route: ShardRoute, policy: UnitPolicy, reshard_after_forward: bool, param_dtype: torch.dtype | None
    ) -> ShardStage:
        return cls(route, policy, reshard_after_forward, param_dtype)

    def lay_out(self, optimizer: Optimizer, signature: Signature | None = None) -> list[ShardedBucket]:
        if self._owners is None:
            return super().lay_out(optimizer, signature)  # before the model is known: laid out again at attach
        world = self.route.world
        groups, bucket_bytes = trainable_groups(optimizer), self.route.bucket_bytes
        owners, shapes = self._owners, self._shapes
        return partition_by_units(groups, owners, world.size, world.index, bucket_bytes, signature, shapes=shapes)

    def attach(
        self, model: Module, optimizers: Sequence[ShardedOptimizer], relay: Callable[[ShardedOptimizer], None]
    ) -> None:
        if self._model is not None and self._model is not model:
            raise ValueError(
                "shard='parameters' shards one model per strategy; this strategy already shards "
                f"{type(self._model).__name__}: give each model its own HorovodStrategy"
            )
        if self._model is model and self.can_reattach():
            self._reattach(list(optimizers))  # sharded before (for other optimizers, or none): unit by unit
            return
        self.detach()  # whole again, sharded anew below
        self._names = find_units(model, self.policy)
        if not self._names and self.policy is not None:
            raise ValueError(
                f"shard='parameters' found no unit in {type(model).__name__} with auto_wrap_policy="
                f"{{{describe_policy(self.policy)}}}: name the classes of its repeated blocks, for example "
                "auto_wrap_policy={Block}, or leave auto_wrap_policy=None (the repeated blocks, else the whole model "
                "as one unit)"
            )
        modules = [module for _, module in self._names]
        self._owners = unit_owners(model, modules)
        self._shapes = {id(p): p.shape for p in model.parameters()}  # whole: a later layout sees the shards
        self._refuse_half_norms_on_cpu(model, self._owners)
        held, self._triggers = outside_units(model, modules)
        self._owners.update((key, len(self._names)) for key in held)  # the model's own unit, gathered in full
        if world_rank() == 0:
            log.info(describe_units(model, self._names, self.policy, len(held)))
        self._names.append(("", model))
        owned = [p for sharded in optimizers for group in sharded.param_groups for p in group["params"]]
        if optimizers and self._owners and not any(id(p) in self._owners for p in owned):
            raise ValueError(
                "shard='parameters' found none of the optimizers' parameters in the model: build the optimizer on "
                "the parameters of the model set up with it (model.parameters() after fabric.setup(model))"
            )
        self._model = model
        self._optimizers = list(optimizers)
        for sharded in self._optimizers:
            relay(sharded)
        self._hold_unstepped(model)
        self._install_from_root(model)
        self._state.hook(model)

    def can_reattach(self) -> bool:
        """Whether the model is sharded and its units' frozen parameters are those it was sharded with (none frozen
        or unfrozen since): a new optimizer then takes the units over one at a time (``_reattach``)."""
        if self._model is None or self._units is None or self._owners is None:
            return False
        return self._frozen_in_units(self._model) == self._held_frozen

    def _reattach(self, optimizers: list[ShardedOptimizer]) -> None:
        """The units laid out again for ``optimizers`` (built over the model's shards, their buckets per unit
        already), one unit at a time: each is gathered from the slices it had (the unstepped store's, or other
        optimizers'), fills the new slices, and lets the old ones go, so no worker ever holds more than one unit
        whole. A parameter that no optimizer holds any more is left whole, as ``attach`` leaves it."""
        assert self._units is not None
        old = self._units
        old.unhook()
        self._optimizers = optimizers
        assert self._model is not None
        self._hold_unstepped(self._model, keep_same=True)
        previous = {unit.index: unit for unit in old.units}
        pieces = self._pieces()
        units: dict[int, Unit] = {}
        kept = {id(each) for each in (*optimizers, self._unstepped) if each is not None}
        for index in sorted(set(previous) | set(pieces)):
            before = previous.get(index)
            if before is not None and adoptable(before.pieces, pieces.get(index, []), kept):
                for (sharded, bucket_index), (old_sharded, old_index) in zip(pieces[index], before.pieces, strict=True):
                    if sharded is not old_sharded:
                        sharded.adopt_slice(bucket_index, old_sharded.slices[old_index].detach())
                before.let_go()
                units[index] = self._unit(index, pieces[index], whole=False)
                continue
            if before is not None:
                before.gather(full=True)
            for sharded, bucket_index in pieces.get(index, []):
                if sharded.unfilled(bucket_index):
                    sharded.fill_slice(bucket_index, self.route.device)
            if index in pieces:
                units[index] = self._unit(index, pieces[index])
            if before is not None:
                placed = {id(p) for p in units[index].parameters()} if index in units else set()
                for parameter in before.parameters():
                    if id(parameter) not in placed:
                        parameter.data = parameter.data.clone()  # whole, of its own
                before.let_go()
            if index in units:
                units[index].free()  # its slices hold it now: the next unit is gathered with this one freed
        for dropped in {id(s): s for unit in old.units for s, _ in unit.pieces if id(s) not in kept}.values():
            dropped.release_slices()  # its memory goes now, whoever still refers to it
        self._hook_units(units)

    def _refuse_half_norms_on_cpu(self, model: Module, owners: dict[int, int]) -> None:
        """Half gathers on the CPU where a unit holds a normalization layer: autocast runs it in float32 there
        without casting its weights, and torch refuses the mix mid-forward. Say so at setup instead."""
        if self.param_dtype is None or self.route.device.type != "cpu":
            return
        if norms := norms_in_units(model, owners):
            raise ValueError(
                f"param_dtype={str(self.param_dtype).removeprefix('torch.')!r} gathers the units in half precision, "
                f"but on the CPU autocast runs normalization layers in float32 without casting their weights, and "
                f"the units hold {norms[:3]}{' ...' if len(norms) > 3 else ''}: use param_dtype='full' on the CPU "
                "(the default, 'auto', does), or keep normalization layers out of the units"
            )

    def _frozen_in_units(self, model: Module) -> set[int]:
        assert self._owners is not None
        return {id(p) for p in model.parameters() if not p.requires_grad and id(p) in self._owners}

    def _hold_unstepped(self, model: Module, keep_same: bool = False) -> None:
        """The units' parameters that no optimizer steps, laid out per unit as the stepped ones are, in slices of
        their own that nothing steps: a worker keeps only its slices of them, with no gradient and no state. Those
        are the frozen ones, and every one while no optimizer is set up (``trainer.validate``, a model set up alone).
        ``keep_same``: slices that hold the same parameters already stay as they are."""
        assert self._owners is not None
        owners = self._owners
        self._held_frozen = self._frozen_in_units(model)
        idle = [p for p in model.parameters() if id(p) in owners and (not p.requires_grad or not self._optimizers)]
        if keep_same and self._unstepped is not None and self._unstepped.parameter_ids() == {id(p) for p in idle}:
            return
        if not idle:
            self._unstepped = None
            return
        world, route = self.route.world, self.route
        # trainable and frozen apart, as an optimizer and the frozen store will hold them: adopted as they are later
        groups = [[p for p in idle if p.requires_grad], [p for p in idle if not p.requires_grad]]
        bucket_bytes = route.bucket_bytes
        buckets = partition_by_units(groups, owners, world.size, world.index, bucket_bytes, None, True, self._shapes)
        self._unstepped = unstepped_slices(buckets, world, route.counters, route.scope)

    def _pieces(self) -> dict[int, list[tuple[BucketSlices, int]]]:
        """Unit index -> the (slices, bucket index) of each of its buckets: the optimizers' and the unstepped ones."""
        pieces: dict[int, list[tuple[BucketSlices, int]]] = {}
        stores: tuple[BucketSlices, ...] = (*self._optimizers, *([self._unstepped] if self._unstepped else []))
        for sharded in stores:
            for index, bucket in enumerate(sharded.buckets):
                if bucket.unit is not None:
                    pieces.setdefault(bucket.unit, []).append((sharded, index))
        return pieces

    def _unit(self, index: int, pieces: Sequence[tuple[BucketSlices, int]], whole: bool = True) -> Unit:
        name, module = self._names[index]
        own = index == len(self._names) - 1  # small and read across the forward: no half-precision copy
        dtype = None if own else self.param_dtype
        return Unit(index, name, module, pieces, self.route.counters, self.route.scope, dtype, whole)

    def _install(self) -> None:
        assert self._model is not None
        self._hold_unstepped(self._model)  # parameters may have been frozen or unfrozen meanwhile
        pieces = self._pieces()
        self._hook_units({index: self._unit(index, its) for index, its in pieces.items()})

    def _hook_units(self, units: Mapping[int, Unit]) -> None:
        """``units`` (by index) hooked and freed; the last index is the model's own unit."""
        own = units.get(len(self._names) - 1)
        blocks = [units[index] for index in sorted(units) if units[index] is not own]
        self._units = ShardedUnits(blocks, self.reshard_after_forward, own, self._triggers)
        self._units.install(self._model, stepped=bool(self._optimizers))
        self._norms = ShardedNorms(self.route.workers // self.route.world.size, self._hidden_gradients())

    def _hidden_gradients(self) -> list[str]:
        """The trainable parameters kept whole whose averaged gradients only the slices hold (no ``.grad`` shows
        them after the sync): a norm over ``model.parameters()`` would miss them (``ShardedNorms``)."""
        assert self._model is not None
        names = parameter_names(self._model)
        return [
            names.get(id(p), ["?"])[0]
            for sharded in self._optimizers
            for bucket in sharded.buckets
            if bucket.unit is None
            for p in bucket.parameters
        ]

    def _install_from_root(self, model: Module) -> None:
        """Rank 0's model, one unit at a time: each unit's parameters, made real where they are on the meta device,
        take rank 0's values, fill this worker's slices and are freed before the next unit is made; what no unit
        owns is made whole, then rank 0's too. A worker whose model was built on the meta device never holds more
        of it than one unit and what no unit owns; every worker runs the same broadcasts, whatever was real."""
        pieces = self._pieces()
        units: dict[int, Unit] = {}

        def finished(index: int) -> None:
            if index not in pieces:
                return
            unit = self._unit(index, pieces[index])
            broadcast_from_root(list(unit.parameters()), f"shard.unit{index}.init")
            for sharded, bucket_index in pieces[index]:
                sharded.fill_slice(bucket_index, self.route.device)
            unit.free()
            units[index] = unit

        materialize(model, self.route.device, [module for _, module in self._names], finished)
        owned = {id(p) for unit in units.values() for p in unit.parameters()}
        whole = [t for t in (*model.parameters(), *model.buffers()) if id(t) not in owned]
        broadcast_from_root(real_tensors(whole), "shard.whole.init")
        for sharded in self._optimizers:
            for bucket_index, bucket in enumerate(sharded.buckets):
                if bucket.unit is None:
                    sharded.fill_slice(bucket_index, self.route.device)
        self._hook_units(units)

    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[None]:
        if self._units is None:
            yield
            return
        self._units.remove()
        try:
            yield
        finally:
            self._install()

    def after_backward(self) -> None:
        if self._units is not None:
            self._units.free_all()  # units whose parameters did not all get gradients
            self._units.show_gradients(self._norms)

    def detach(self) -> None:
        self._state.unhook()
        if self._units is not None:
            self._units.remove()
        self._units, self._owners, self._model, self._optimizers = None, None, None, []
        self._unstepped = None

    def abandon(self) -> None:
        """The units' parameters left placeholders, gathering nothing: the next setup makes them real a unit at a
        time and the commit's slices (kept with the optimizer parts) give them their values."""
        self._state.unhook()
        if self._units is not None:
            self._units.abandon()
        self._units, self._owners, self._model, self._optimizers = None, None, None, []
        self._unstepped = None

    def model_state_dict(self, model: Module, committing: bool = False) -> dict[str, Any]:
        if self._units is None:
            return model.state_dict()
        return self._state.whole(model) if not committing else self._state.committed(model)

    def load_model_state_dict(self, model: Module, state: Mapping[str, Any], strict: bool) -> None:
        self._state.load(model, state, strict)

    def model_pieces(self, model: Module) -> dict[str, Any]:
        return model.state_dict() if self._units is None else self._state.pieces(model, self.whole_shape)

    def whole_shape(self, parameter: Parameter) -> torch.Size:
        """A unit's parameter holds this worker's shard: its whole shape is the one taken when it was sharded."""
        return self._shapes.get(id(parameter), parameter.shape)

    def local_shards(self) -> dict[str, LocalShard]:
        """This worker's part of each sharded parameter, by state dict name (``UnitStates.local_shards``)."""
        if self._units is None or self._model is None:
            raise RuntimeError("local_shards: the model is not sharded yet; call it after the strategy set it up")
        return self._state.local_shards(self._model)


SHARD_STAGES: dict[str, type[ShardStage]] = {
    stage.shard: stage for stage in (OptimizerStage, GradientStage, ParameterStage)
}
"""``shard=`` names and the stage each stands for."""


def adoptable(old: Sequence[tuple[BucketSlices, int]], new: Sequence[tuple[BucketSlices, int]], kept: set[int]) -> bool:
    """Whether a unit's new buckets are its old ones laid out alike (the same parameters, layout and dtype, one by
    one), each old one either the same or of a store let go: the new slices are then the old ones, no gather."""

    def described(pieces: Sequence[tuple[BucketSlices, int]]) -> list[tuple[object, ...]]:
        return [(tuple(map(id, s.buckets[i].parameters)), s.buckets[i].flat, s.slices[i].dtype) for s, i in pieces]

    if not new or described(old) != described(new):
        return False
    return all(s is t or (id(s) not in kept and not s.unfilled(i)) for (s, i), (t, _) in zip(old, new, strict=True))


class _Done(InFlight[torch.Tensor]):
    """A result that needs no collective (a job of one worker)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def progress(self) -> None:
        """Nothing in flight."""

    def ready(self) -> bool:
        return True

    def wait(self, meanwhile: Meanwhile = None) -> torch.Tensor:
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
