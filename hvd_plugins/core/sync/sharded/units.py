"""``shard="parameters"`` (ZeRO-3): the model's units, whose parameters are whole only while the unit computes.

A unit is a module the policy picks (``auto_wrap_policy``); it owns the trainable parameters registered under
it and under no unit inside it. What no one unit owns forms the model's own unit (an embedding and the output
head tied to it, a final norm: ``outside_units``), whole from the first forward of a step to the step's sync,
as FSDP's root. A parameter registered on the model itself stays whole on every worker, as with
``shard="gradients"``. A unit's frozen parameters are sharded too, in buckets of their own that no optimizer
steps (no gradient, no state): a frozen base under trainable adapters is held as its slices.

A unit's parameters are laid out in buckets (``partition_by_units``) whose slices (``slices.BucketSlices``) an
optimizer steps, or, for those no optimizer steps, a store of their own; this worker's slices of them are their only
copy between computations: the whole parameters are freed, and each Parameter (kept, so optimizers, hooks and names
still hold it) is its part of this worker's slice, a 1-D view of what the optimizer steps, as FSDP's
``use_orig_params`` shows its shards; after the step's sync its ``.grad`` is its part of the averaged gradient
(``shard_gradients``). Before the unit's forward they are allgathered from the slices into one flat buffer per
bucket, which each parameter then views. After the forward they are freed again (``reshard_after_forward``),
gathered again when backward reaches the unit's outputs, and freed once backward has accumulated their gradients,
which the stage reduce-scatters from backward's hooks as ZeRO-2 does. A gather reads the slices as they are, so a
step needs no gather of its own.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module, Parameter
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.in_flight import InFlight, finish_all
from hvd_plugins.core.comm.partners import start_slices_gather
from hvd_plugins.core.comm.wire import nbytes
from hvd_plugins.core.config import UnitPolicy, describe_policy, policy_picks
from hvd_plugins.core.sync.meta import leave_placeholder
from hvd_plugins.core.sync.sharded.shard_gradients import ShardedNorms, ShardGradient
from hvd_plugins.core.sync.sharded.slices import BucketSlices

log = logging.getLogger(__name__)


def find_units(model: Module, policy: UnitPolicy) -> list[tuple[str, Module]]:
    """The units of ``model`` by ``policy`` (module classes or a function of a module), in module order; without a
    policy, its repeated blocks (``repeated_blocks``). Only modules whose forward is called can be units: a container
    (``nn.ModuleList``) is never picked, its members may be.

    The model itself is never picked: what no unit owns goes to its own unit (``outside_units``), gathered for the
    whole forward and backward, as FSDP's root. Units may nest; a unit owns what is registered under it and under
    none of its own units.
    """
    if policy is None:
        return repeated_blocks(model)
    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if module is not model and runs_forward(module) and policy_picks(policy, module)
    ]
    return chosen


def repeated_blocks(model: Module) -> list[tuple[str, Module]]:
    """The blocks a model repeats, as torchtitan, litgpt and Hugging Face wrap them: the classes the model declares
    unsplittable (Hugging Face's ``_no_split_modules``), else the members of every ``ModuleList`` or ``Sequential``
    of two or more modules of one class that holds parameters (the outermost such; their insides are theirs).
    Everything else belongs to the model's own unit. A model that repeats nothing has no unit but its own: slow, as
    FSDP wrapping only the root is, and correct whatever its forward reads."""
    declared = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    found: list[tuple[str, Module]] = []

    def visit(prefix: str, module: Module) -> None:
        children = list(module.named_children())
        if declared:
            picked = [(f"{prefix}{n}", c) for n, c in children if type(c).__name__ in declared and runs_forward(c)]
        else:
            picked = children if _repeats_one_block(module) else []
            picked = [(f"{prefix}{n}", c) for n, c in picked]
        found.extend(picked)
        taken = {id(c) for _, c in picked}
        for name, child in children:
            if id(child) not in taken:
                visit(f"{prefix}{name}.", child)

    visit("", model)
    return found


def _repeats_one_block(module: Module) -> bool:
    """Whether ``module`` is a ``ModuleList`` or ``Sequential`` of two or more modules of one class, with parameters."""
    if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        return False
    members = list(module.children())
    return (
        len(members) >= 2
        and len({type(member) for member in members}) == 1
        and runs_forward(members[0])
        and any(True for _ in module.parameters())
    )


def describe_units(model: Module, units: Sequence[tuple[str, Module]], policy: UnitPolicy, own: int) -> str:
    """One line: which units were chosen and by what, and how many parameters the model's own unit holds."""
    how = "its repeated blocks" if policy is None else f"auto_wrap_policy={{{describe_policy(policy)}}}"
    if not units:
        return (
            f"shard='parameters': {type(model).__name__} repeats no block, so the whole model is one unit "
            f"({own} parameter tensors), gathered for each step; name its blocks in auto_wrap_policy to gather "
            "less at once"
        )
    classes: dict[str, int] = {}
    for _, module in units:
        classes[type(module).__name__] = classes.get(type(module).__name__, 0) + 1
    kinds = ", ".join(f"{count} x {name}" for name, count in classes.items())
    names = [name for name, _ in units]
    shown = ", ".join(names[:3]) + (f", ..., {names[-1]}" if len(names) > 4 else "".join(f", {n}" for n in names[3:]))
    return (
        f"shard='parameters': {len(units)} units by {how} ({kinds}: {shown}); {own} parameter tensors outside them "
        "form the model's own unit"
    )


def runs_forward(module: Module) -> bool:
    """Whether calling ``module`` runs a forward of its own (a ModuleList's or ModuleDict's is never called)."""
    return type(module).forward is not Module.forward


def unit_owners(model: Module, units: Sequence[Module]) -> dict[int, int]:
    """Parameter id -> index of the unit owning it: registered under that unit (the innermost) and nowhere else."""
    owners: dict[int, int] = {}
    for key, units_of in _places(model, units).items():
        (only,) = units_of if len(units_of) == 1 else (None,)
        if only is not None:
            owners[key] = only
    return owners


def _places(model: Module, units: Sequence[Module]) -> dict[int, set[int | None]]:
    """Parameter id -> the units it is registered under (None: outside every unit), looking through shared modules."""
    index_of = {id(module): index for index, module in enumerate(units)}
    places: dict[int, set[int | None]] = {}

    def walk(module: Module, unit: int | None, seen: set[int]) -> None:
        if id(module) in seen:
            return
        seen = seen | {id(module)}
        for parameter in module._parameters.values():
            if parameter is not None:
                places.setdefault(id(parameter), set()).add(unit)
        for child in module._modules.values():
            if child is not None:
                walk(child, index_of.get(id(child), unit), seen)

    walk(model, None, set())
    return places


def outside_units(model: Module, units: Sequence[Module]) -> tuple[set[int], list[Module]]:
    """What the model's own unit holds: the ids of the parameters no one unit owns (registered outside every unit,
    or under two places: an embedding and the output head tied to it), and the modules whose forward gathers it:
    those that register such a parameter (a unit too, which may hold nothing else).

    A parameter registered on the model itself stays whole, as one on a module outside the units that is never
    called (a ``ParameterList``): a Trainer never calls the model's forward (a LightningModule runs
    ``training_step``), so no hook would gather it before it is read."""
    places = _places(model, units)
    unit_ids = {id(module) for module in units}
    on_model = {id(p) for p in model._parameters.values() if p is not None}
    holders: dict[int, list[Module]] = {}  # parameter id -> the modules outside the units that register it
    for module in _modules_outside(model, unit_ids):
        for parameter in module._parameters.values():
            if parameter is not None:
                holders.setdefault(id(parameter), []).append(module)
    held = {
        key
        for key, where in places.items()
        if len(where) > 1 or where == {None}
        if key not in on_model and all(runs_forward(module) for module in holders.get(key, []))
    }
    inside = [units[index] for key in held for index in places[key] if index is not None]  # tied into a unit
    triggers = {id(module): module for key in held for module in holders.get(key, [])}
    triggers.update((id(module), module) for module in inside)
    return held, list(triggers.values())


def _modules_outside(model: Module, unit_ids: set[int]) -> list[Module]:
    """The modules of ``model`` under no unit (each once), the model itself first."""
    found: list[Module] = []
    seen: set[int] = set()

    def walk(module: Module) -> None:
        if id(module) in seen or id(module) in unit_ids:
            return
        seen.add(id(module))
        found.append(module)
        for child in module._modules.values():
            if child is not None:
                walk(child)

    walk(model)
    return found


NORMALIZATIONS: tuple[type[Module], ...] = (
    torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm, torch.nn.RMSNorm,
)  # fmt: skip
"""Layers that autocast runs in float32 on the CPU without casting their weights: half weights there fail."""


def norms_in_units(model: Module, owners: dict[int, int]) -> list[str]:
    """The normalization layers of ``model`` whose weights a unit owns (names in the model)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, NORMALIZATIONS) and any(id(p) in owners for p in module.parameters(recurse=False))
    ]


class Unit:
    """One unit's sharded parameters, gathered whole from their slices and freed again together.

    Each bucket of the unit has one flat buffer, padded as its layout, that its parameters view while the unit is
    whole. Freeing resizes the buffer's storage to nothing and leaves each parameter an empty tensor, so the
    memory goes even where autograd saved a view of a weight for backward (``weight.t()`` in a linear layer);
    gathering refills the same storage, so such a view reads the gathered values again.
    """

    def __init__(
        self,
        index: int,
        name: str,
        module: Module,
        pieces: Sequence[tuple[BucketSlices, int]],
        counters: CommCounters,
        scope: Scope,
        compute_dtype: torch.dtype | None = None,
        whole: bool = True,
    ) -> None:
        self.index, self.name, self.module = index, name, module
        self.pieces = list(pieces)  # (slices, bucket index) of every bucket of this unit
        self.counters, self.scope = counters, scope
        self.compute_dtype = compute_dtype
        """The dtype the unit is gathered in to compute (``param_dtype``; None: the slices' own)."""
        self.masters = [sharded.slices[i].dtype for sharded, i in self.pieces]  # each bucket's slice dtype
        self.accumulated = 0
        self.trainable = sum(1 for parameter in self.parameters() if parameter.requires_grad)
        """Parameters whose gradients backward accumulates in this unit: when all have, the unit is freed."""
        self.frozen = self.trainable < sum(1 for _ in self.parameters())
        """Whether some of its parameters are frozen: backward may still read them (the gradient of the unit's input
        goes through them) after every trainable one has its gradient."""
        self.awaiting_input_gradients = False
        """With ``frozen``: the unit's inputs need gradients this backward, which it has not computed yet."""
        self.flats: list[torch.Tensor] = []
        self.whole = whole
        """``whole``: the parameters are whole now and fill the flat buffers; else the slices already hold them."""
        self._pending: list[InFlight[list[torch.Tensor]] | None] | None = None  # a gather started, not finished
        for sharded, index_ in self.pieces:
            bucket, piece = sharded.buckets[index_], sharded.slices[index_]
            if whole:
                with torch.no_grad():
                    flat = bucket.flat.pack([p.detach() for p in bucket.parameters], padded=True)
            else:
                flat = torch.empty(bucket.flat.padded_numel, dtype=piece.dtype, device=piece.device)
                flat.untyped_storage().resize_(0)  # memory only while gathered
            self.flats.append(flat)
        if whole:
            self._view()
        else:
            self._view_shards()

    def parameters(self) -> Iterable[Parameter]:
        for sharded, index in self.pieces:
            yield from sharded.buckets[index].parameters

    def _view(self) -> None:
        """Each parameter a view of its bucket's flat buffer; a gradient left as its shard (``show_gradients``) goes:
        backward accumulates whole gradients into the bucket, and the step reads the slices' own."""
        for (sharded, index), flat in zip(self.pieces, self.flats, strict=True):
            bucket = sharded.buckets[index]
            for parameter, view in zip(bucket.parameters, bucket.flat.views(flat), strict=True):
                if isinstance(parameter.grad, ShardGradient):
                    parameter.grad = None
                parameter.data = view

    def _view_shards(self) -> None:
        """Each parameter its part of this worker's slice, a 1-D view of what the optimizer steps (empty where the
        slice holds none of it): between computations the model holds its shards, as FSDP's ``use_orig_params``."""
        for sharded, index in self.pieces:
            bucket = sharded.buckets[index]
            views = bucket.flat.shard_views(sharded.slices[index].detach())
            for parameter, view in zip(bucket.parameters, views, strict=True):
                parameter.data = view

    def show_gradients(self, norms: ShardedNorms) -> None:
        """Each trainable parameter's ``.grad`` its part of the averaged gradient (a view of its slice's), once the
        step's sync has landed and the unit is freed: torch's clipping and norms see the shards (``ShardGradient``)."""
        if self.whole:
            return
        for sharded, index in self.pieces:
            bucket, piece = sharded.buckets[index], sharded.slices[index]
            if piece.grad is None:
                continue
            for parameter, view in zip(bucket.parameters, bucket.flat.shard_views(piece.grad), strict=True):
                if parameter.requires_grad:
                    parameter.grad = ShardGradient.of(view, norms)

    def _dtypes(self, full: bool) -> list[torch.dtype]:
        """Each bucket's gather dtype: the slices' own when ``full``, else the compute dtype where one is set."""
        return [master if full or self.compute_dtype is None else self.compute_dtype for master in self.masters]

    def start_gather(self, full: bool = False) -> None:
        """Start allgathering every bucket's slices into its flat buffer (refilled); ``gather`` finishes it. A
        gather started early (prefetched) moves while the unit before it computes. ``full``: in the slices' own
        dtype even where the unit computes in another (a checkpoint, a load, the end of the fit)."""
        wanted = self._dtypes(full)
        if [flat.dtype for flat in self.flats] == wanted and (self.whole or self._pending is not None):
            return  # whole, or on its way, in the dtype wanted
        if self._pending is not None:
            self._finish()  # every worker started that gather: finish it alike before the next
        self.free()  # whole in the other dtype
        for position, dtype in enumerate(wanted):
            old = self.flats[position]
            if old.dtype != dtype:  # a new buffer: views autograd saved are of a finished step
                self.flats[position] = torch.empty(old.numel(), dtype=dtype, device=old.device)
        pending: list[InFlight[list[torch.Tensor]] | None] = []
        for (sharded, index), flat in zip(self.pieces, self.flats, strict=True):
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            piece, world = sharded.slices[index].detach().to(flat.dtype), sharded.world
            if world is None or world.size == 1:
                flat.data.copy_(piece)
                pending.append(None)
                continue
            pending.append(start_slices_gather(piece, world, f"{sharded.name}.unit{self.index}.{index}"))
            self.counters.record(self.scope, nbytes(piece))  # the payload handed over, as ZeRO-2's gather counts it
        self._pending = pending

    def gather(self, full: bool = False) -> None:
        """Every bucket's slices allgathered into its flat buffer, which the parameters view again (``full``: in the
        slices' own dtype, see ``start_gather``)."""
        self.start_gather(full)  # nothing when already whole in that dtype
        if self._pending is not None:
            self._finish()

    def _finish(self) -> None:
        """The gather started last, landed in the flat buffers, which the parameters view."""
        assert self._pending is not None
        started = [operation for operation in self._pending if operation is not None]
        with self.counters.waiting():
            gathered = iter(finish_all(started))
        for operation, flat in zip(self._pending, self.flats, strict=True):
            if operation is None:
                continue
            torch.cat(next(gathered), out=flat.data)  # every worker's slice, in the layout's order
        self._pending = None
        self.whole = True
        self._view()

    def free(self) -> None:
        """The whole parameters dropped, their memory too; each Parameter holds its part of the slice again."""
        if self._pending is not None:
            self._finish()  # a prefetched gather the step did not use: every worker finishes it alike
        if not self.whole:
            return
        self._view_shards()
        for flat in self.flats:
            flat.untyped_storage().resize_(0)
        self.whole = False

    def let_go(self) -> None:
        """The flat buffers dropped, the parameters left as they are (another unit now holds them: a re-layout). A
        gather still on its way (started by a backward that was refused) is finished first, as every worker does."""
        if self._pending is not None:
            started = [operation for operation in self._pending if operation is not None]
            with self.counters.waiting():
                finish_all(started)
            self._pending = None
        for flat in self.flats:
            flat.untyped_storage().resize_(0)
        self.flats.clear()
        self.whole = False

    def release(self) -> None:
        """Whole for good (a fit's end): each parameter a tensor of its own, the flat buffers let go."""
        self.gather(full=True)
        for parameter in self.parameters():
            parameter.data = parameter.data.clone()
        self.flats.clear()

    def abandon(self) -> None:
        """The slices went with the old world (an elastic reset): no collective may run. Each parameter is left a
        placeholder of its shape (``meta.leave_placeholder``) and the flat buffers let go; a commit's slices give
        the next layout its values."""
        self._pending = None
        for (sharded, index), master in zip(self.pieces, self.masters, strict=True):
            bucket = sharded.buckets[index]
            for parameter, shape in zip(bucket.parameters, bucket.shapes, strict=True):
                parameter.grad = None  # a shard's, of the old world
                leave_placeholder(parameter, shape, master)
        self.flats.clear()
        self.whole = False

    def take_slices(self) -> None:
        """The slices from the whole parameters as they are now (a loaded model state): the unit must be whole, in
        the slices' own dtype."""
        assert self.whole and [flat.dtype for flat in self.flats] == self.masters
        for sharded, index in self.pieces:
            bucket = sharded.buckets[index]
            with torch.no_grad():
                bucket.read_slice([p.detach() for p in bucket.parameters], sharded.slices[index].data)


class ShardedUnits:
    """The units of one model and the hooks that gather and free them around forward and backward."""

    def __init__(
        self,
        units: Sequence[Unit],
        reshard_after_forward: bool,
        own: Unit | None = None,
        triggers: Sequence[Module] = (),
    ) -> None:
        self.units = list(units) + ([own] if own is not None else [])
        """Every unit, the model's own last."""
        self.reshard_after_forward = reshard_after_forward
        self.own = own
        """The model's own unit (``outside_units``): gathered by the first forward of ``triggers`` or of a unit and
        whole until the step's sync, as FSDP keeps its root: its embedding is read again by a tied output head at
        the end of forward, and backward starts there."""
        self.triggers = list(triggers)
        self._handles: list[RemovableHandle] = []
        self._order: list[Unit] = []
        """The units in the order the last whole forward ran them: whose gather to start next (prefetch)."""
        self._position: dict[int, int] = {}  # unit index -> its place in ``_order``
        self._running: list[Unit] = []  # the order of the forward running now
        self._ran: set[int] = set()  # the indices of ``_running``'s units
        self._recorded = False
        """Whether a forward recorded gradients since the last sync (a backward to come reads whole units)."""

    def install(self, model: Module | None = None, stepped: bool = True) -> None:
        """Hook every unit and free its parameters: from now on only the slices hold them. After a forward of
        ``model`` that records no gradient (evaluation), every unit is freed at once: no sync will free them.
        ``stepped``: whether an optimizer steps the units (else a backward is refused: no slice takes gradients)."""
        for module in self.triggers:
            self._handles.append(module.register_forward_pre_hook(self._before_own_use()))
        if model is not None:
            self._handles.append(model.register_forward_hook(self._after_evaluation()))
            names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
            for module in {id(m): m for m in (model, *self.triggers, *(u.module for u in self.units))}.values():
                self._handles.append(module.register_forward_hook(self._explain_failure(names), always_call=True))
        for unit in self.units:
            unit.free()
            if unit is self.own:
                continue  # whole until the step's sync (``free_all``), however many backward passes it takes
            self._handles.append(unit.module.register_forward_pre_hook(self._before_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._after_forward(unit)))
            for parameter in unit.parameters():
                if parameter.requires_grad:
                    self._handles.append(parameter.register_post_accumulate_grad_hook(self._accumulated(unit)))
        if not stepped:
            trainable = [p for unit in self.units for p in unit.parameters() if p.requires_grad]
            self._handles += [parameter.register_hook(refuse_gradient) for parameter in trainable]

    def remove(self) -> None:
        """Every unit whole again, each parameter a tensor of its own, and unhooked."""
        for unit in self.units:
            unit.release()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def unhook(self) -> None:
        """The hooks removed, the units left as they are (a new layout takes their parameters over)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def show_gradients(self, norms: ShardedNorms) -> None:
        """Every freed unit's parameters given their parts of the averaged gradients (``Unit.show_gradients``)."""
        for unit in self.units:
            unit.show_gradients(norms)

    def abandon(self) -> None:
        """Unhooked, every unit's parameters placeholders, with no collective (the world they were split over is
        gone)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self.units:
            unit.abandon()

    def free_all(self) -> None:
        for unit in self.units:
            unit.free()
        self._recorded = False

    def _before_own_use(self) -> Callable[..., None]:
        def gather(module: Module, args: Any) -> None:
            if self.own is not None and not self.own.whole and self._order and not in_backward():
                self._order[0].start_gather()  # the first unit's gather moves while the embedding computes
            self._gather_own()

        return eager(gather)

    def _after_evaluation(self) -> Callable[..., None]:
        def free(module: Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() and not self._recorded and not in_backward():
                self.free_all()  # not inside a training step: a backward to come may read what is whole

        return eager(free)

    def _explain_failure(self, names: Mapping[int, str]) -> Callable[..., None]:
        """On an error raised inside a forward: a note that names the parameters read while their unit was freed."""

        def explain(module: Module, args: Any, output: Any) -> None:
            error = sys.exc_info()[1]
            if not isinstance(error, RuntimeError) or getattr(error, EXPLAINED, False):
                return
            note = self.freed_read_note(names, error)
            if note is None:
                return
            setattr(error, EXPLAINED, True)
            if hasattr(error, "add_note"):
                error.add_note(note)
            else:  # Python 3.10
                log.error(note)

        return eager(explain)

    def freed_read_note(self, names: Mapping[int, str], error: BaseException) -> str | None:
        """Which freed parameters the failing forward may have read (those under the innermost module whose forward
        raised, in the units not gathered for it first), their units, and the fix; None when every unit is whole."""
        freed = [unit for unit in self.units if not unit.whole]
        if not freed:
            return None
        inner = innermost_module(error)
        under = {id(p) for p in inner.parameters()} if inner is not None else None
        never = [unit for unit in freed if unit is not self.own and unit.index not in self._ran]
        suspects: list[str] = []
        for unit in sorted(freed, key=lambda unit: unit not in never):
            read = [names.get(id(p), "?") for p in unit.parameters() if under is None or id(p) in under]
            if read:
                why = "never called, so never gathered" if unit in never else "freed after its own forward"
                shown = ", ".join(read[:3]) + (", ..." if len(read) > 3 else "")
                suspects.append(f"{shown} (unit {unit.name or '(the model)'!r}, {type(unit.module).__name__}: {why})")
        if not suspects:
            return None
        return (
            "shard='parameters': this forward may have read a parameter while its unit was freed (an empty tensor): "
            f"{'; '.join(suspects[:4])}. A parameter read outside the forward of the unit holding it (a weight tied "
            "by use, or read by its parent, as nn.MultiheadAttention reads out_proj.weight) needs a unit whose "
            "forward encloses the read: put the module that reads it in auto_wrap_policy (its block), or leave "
            "auto_wrap_policy=None (the repeated blocks, and the rest whole for the whole step)."
        )

    def _gather_own(self) -> None:
        self._recorded = self._recorded or torch.is_grad_enabled()
        if self.own is not None and not self.own.whole:
            self.own.gather()

    def _before_forward(self, unit: Unit) -> Callable[..., None]:
        def gather(module: Module, args: Any) -> None:
            self._gather_own()  # the model's forward may read its own parameters without calling their modules
            unit.accumulated = 0  # a backward that left some parameters without gradients counted them short
            unit.awaiting_input_gradients = False
            unit.gather()
            if in_backward():
                return  # a recompute (activation checkpointing): the order of forward is not this
            if unit.index in self._ran:  # a new forward: the last one's order is known
                self._order, self._running, self._ran = self._running, [], set()
                self._position = {each.index: place for place, each in enumerate(self._order)}
            self._running.append(unit)
            self._ran.add(unit.index)
            self._prefetch(unit, 1)

        return eager(gather)

    def _prefetch(self, unit: Unit, direction: int) -> None:
        """Start the gather of the unit that runs after ``unit`` (forward: ``direction`` 1; backward: -1)."""
        place = self._position.get(unit.index)
        if place is None:
            return
        position = place + direction
        if 0 <= position < len(self._order):
            self._order[position].start_gather()

    def _after_forward(self, unit: Unit) -> Callable[..., None]:
        def after(module: Module, args: Any, output: Any) -> None:
            if in_backward():
                return  # a recompute inside backward (activation checkpointing): backward uses these parameters
            needing = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            for tensor in needing:
                tensor.register_hook(self._before_backward(unit))
            inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
            if unit.frozen and needing and inputs:  # free it once backward has gone through it to its inputs
                unit.awaiting_input_gradients = True
                torch.autograd.graph.register_multi_grad_hook(inputs, self._inputs_done(unit), mode="all")
            last = bool(self._order) and self._order[-1] is unit  # backward needs it first: no gather to wait for
            if not needing or (self.reshard_after_forward and not last):
                unit.free()

        return eager(after)

    def _before_backward(self, unit: Unit) -> Callable[[torch.Tensor], None]:
        def gather(gradient: torch.Tensor) -> None:
            unit.gather()
            self._prefetch(unit, -1)

        return eager(gather)

    def _accumulated(self, unit: Unit) -> Callable[[torch.Tensor], None]:
        def count(parameter: torch.Tensor) -> None:
            unit.accumulated += 1
            self._free_when_done(unit)

        return eager(count)

    def _inputs_done(self, unit: Unit) -> Callable[[Sequence[torch.Tensor | None]], None]:
        def done(gradients: Sequence[torch.Tensor | None]) -> None:
            unit.awaiting_input_gradients = False
            self._free_when_done(unit)

        return eager(done)

    @staticmethod
    def _free_when_done(unit: Unit) -> None:
        """Free ``unit`` once backward needs it no more: every trainable parameter has its gradient and, where some
        are frozen, the gradients of its inputs are computed."""
        if unit.accumulated >= unit.trainable and not unit.awaiting_input_gradients:
            unit.free()


EXPLAINED = "_hvd_plugins_freed_read_explained"
"""Marks an error that already carries the note naming the freed parameters (each module's hook would add it)."""


def innermost_module(error: BaseException) -> Module | None:
    """The innermost module whose own forward code raised ``error`` (the last frame whose ``self`` is a Module)."""
    found: Module | None = None
    trace = error.__traceback__
    while trace is not None:
        owner = trace.tb_frame.f_locals.get("self")
        if isinstance(owner, Module) and trace.tb_frame.f_code.co_name == "forward":
            found = owner
        trace = trace.tb_next
    return found


def refuse_gradient(gradient: torch.Tensor) -> None:
    """A backward through units that no optimizer steps: their gradients would have nowhere to go. Every worker
    raises at the same parameter (a unit's gather that backward started is finished alike when the units are laid
    out for an optimizer, ``Unit.let_go``)."""
    raise ValueError(
        "shard='parameters' averages each gradient into the slices an optimizer steps, and no optimizer is set up "
        "over this model yet: set one up (fabric.setup_optimizers(optimizer), or fabric.setup(model, optimizer)) "
        "before calling backward"
    )


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recompute runs forward inside one)."""
    return torch._C._current_graph_task_id() != -1


def eager(hook: Callable[..., None]) -> Callable[..., None]:
    """``hook`` kept out of graphs ``torch.compile`` captures: it runs as written, between them. Traced, the
    freeing of a unit (``parameter.data = ...``) would become a mutation of the graph's inputs, replayed after
    the graph with the parameters' version bumped, and backward would refuse the weights it saved.

    It also runs outside ``torch.inference_mode`` (Lightning's validate and predict loops run in it), with grad mode
    as it was: a gather's buffers and a freed parameter's empty tensor must stay normal tensors, which Horovod's
    thread may write and a later training step may save for backward."""

    def outside_inference_mode(*args: Any, **kwargs: Any) -> None:
        if not torch.is_inference_mode_enabled():
            return hook(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return hook(*args, **kwargs)

    return torch._dynamo.disable(outside_inference_mode, recursive=True)
