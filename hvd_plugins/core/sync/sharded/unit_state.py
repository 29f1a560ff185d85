"""The state of a fully sharded model (``shard="parameters"``) as checkpoints and users see it.

The model's own ``state_dict()`` gives whole tensors and its ``load_state_dict`` takes them, one unit at a time,
as FSDP's full state dict does (a collective: every worker calls them); an elastic commit keeps this worker's
slices instead; ``local_shards()`` gives this worker's part of each parameter by name, with no collective.
Checkpoint formats build on these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module, Parameter
from torch.utils.hooks import RemovableHandle

from hvd_plugins.core.checkpoint.boxes import FlatPieces
from hvd_plugins.core.comm.shards import LocalShard
from hvd_plugins.core.comm.world import world_rank
from hvd_plugins.core.sync.sharded.units import ShardedUnits, eager

UNITS_IN_PARTS_KEY = "hvd_plugins_units_in_optimizer_parts"
"""Marks the model state of an elastic commit under ``shard="parameters"``: it holds what no unit owns, and the
units' values are the slices kept with the commit's optimizer parts."""


class UnitStates:
    """The state dict of a model whose units ``units()`` gives (None: not sharded now)."""

    def __init__(self, units: Callable[[], ShardedUnits | None]) -> None:
        self._units = units
        self._hooks: list[RemovableHandle] = []
        self._raw_state = False  # inside: state_dict and load_state_dict as this worker holds the parameters
        self._whole_on_rank_zero_only = False  # a checkpoint: only rank 0, which writes it, keeps the gathered copies

    def whole(self, model: Module) -> dict[str, Any]:
        """The whole state, gathered unit by unit (a collective, ``_whole_state``): rank 0, which writes checkpoints,
        keeps a copy of each unit's parameters, one unit whole at a time; the other workers' states hold their
        shards (views, no copy)."""
        self._whole_on_rank_zero_only = True
        try:
            return model.state_dict()
        finally:
            self._whole_on_rank_zero_only = False

    def committed(self, model: Module) -> dict[str, Any]:
        """An elastic commit's model state, with no gather: the state of what no unit owns, marked
        ``UNITS_IN_PARTS_KEY``; the units' values are this worker's slices, which the commit keeps with the optimizer
        parts (and a copy elsewhere); frozen ones, which no optimizer part holds, whole."""
        names = parameter_names(model)
        owned = self._owned_names(names)
        with self._state_as_held():
            state = {key: value for key, value in model.state_dict().items() if key not in owned}
        state.update(self._frozen_whole(names))
        state[UNITS_IN_PARTS_KEY] = True
        return state

    def pieces(self, model: Module, whole_shape: Callable[[Parameter], torch.Size]) -> dict[str, Any]:
        """The state as a DCP checkpoint saves and loads it, with no gather: this worker's part of each unit's
        parameter (``FlatPieces``, views of its slices; none of it where it holds no element), and what no unit owns
        as every worker holds it."""
        names = parameter_names(model)
        owned = self._owned_names(names)
        with self._state_as_held():
            state: dict[str, Any] = {key: value for key, value in model.state_dict().items() if key not in owned}
        units = self._units()
        assert units is not None
        for parameter in (p for unit in units.units for p in unit.parameters()):
            nothing = LocalShard(parameter.detach()[:0], 0, whole_shape(parameter))
            state.update((name, FlatPieces(nothing)) for name in names.get(id(parameter), []))
        state.update((name, FlatPieces(shard)) for name, shard in self.local_shards(model).items())
        return state

    def load(self, model: Module, state: Mapping[str, Any], strict: bool) -> None:
        """A whole state loaded one unit at a time, each worker keeping its slices of it (``_load_whole``); an
        elastic commit's state holds what no unit owns, the units' slices come with its optimizer parts."""
        if self._units() is None:
            model.load_state_dict({k: v for k, v in state.items() if k != UNITS_IN_PARTS_KEY}, strict=strict)
            return
        if not state.get(UNITS_IN_PARTS_KEY):
            model.load_state_dict(state, strict=strict)
            return
        owned = self._owned_names(parameter_names(model))
        frozen = {key: value for key, value in state.items() if key in owned}  # whole: into their slices
        if frozen:
            model.load_state_dict(frozen, strict=False)
        with self._state_as_held():
            result = model.load_state_dict({k: v for k, v in state.items() if k not in owned}, strict=False)
        unexpected = [key for key in result.unexpected_keys if key != UNITS_IN_PARTS_KEY]
        missing = [key for key in result.missing_keys if key not in owned]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(model).__name__}: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )

    @contextlib.contextmanager
    def _state_as_held(self) -> Iterator[None]:
        """Inside, the model's ``state_dict`` and ``load_state_dict`` see the parameters as this worker holds them."""
        self._raw_state = True
        try:
            yield
        finally:
            self._raw_state = False

    def hook(self, model: Module) -> None:
        """The model's own ``state_dict()`` gives whole tensors and ``load_state_dict`` takes them, as FSDP's full
        state dict does (a collective: every worker calls them): what ``save_pretrained``-style code expects."""

        def whole_state(module: Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
            self._whole_state(module, state, prefix, metadata)

        def load_whole(module: Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
            self._load_whole(module, state, prefix, *args)

        # functions, not bound methods: copy.deepcopy(model) (an EMA copy) copies a function as it is, a method's self;
        # run outside inference mode (a validation_step of trainer.validate may ask): Horovod's thread writes gathers
        self._hooks = [
            model._register_state_dict_hook(eager(whole_state)),
            model._register_load_state_dict_pre_hook(eager(load_whole), with_module=True),
        ]

    def unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _whole_state(self, model: Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        """``state_dict``'s units' entries replaced by the whole tensors, gathered one unit at a time."""
        units = self._units()
        if units is None or self._raw_state:
            return
        names = parameter_names(model)
        keep = not self._whole_on_rank_zero_only or world_rank() == 0
        for unit in units.units:
            was_whole = unit.whole
            unit.gather(full=True)
            for parameter in unit.parameters() if keep else ():
                copy = parameter.detach().clone()
                state.update((prefix + name, copy) for name in names.get(id(parameter), []) if prefix + name in state)
            if not was_whole:
                unit.free()

    def _load_whole(self, model: Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """Whole tensors of ``state`` taken into the units' slices, one unit at a time; their entries then left as
        the parameters are held, for the modules' own loading to pass over."""
        units = self._units()
        if units is None or self._raw_state:
            return
        names = parameter_names(model)
        for unit in units.units:
            keys = {id(p): first_key(names.get(id(p), []), prefix, state) for p in unit.parameters()}
            if not any(keys.values()):
                continue
            was_whole = unit.whole
            unit.gather(full=True)
            with torch.no_grad():
                for parameter in unit.parameters():
                    key = keys[id(parameter)]
                    if key is None:
                        continue
                    value = state[key]
                    if value.shape != parameter.shape:
                        raise RuntimeError(
                            f"size mismatch for {key}: the state holds {tuple(value.shape)}, the model "
                            f"{tuple(parameter.shape)}"
                        )
                    parameter.copy_(value)
            unit.take_slices()
            if not was_whole:
                unit.free()
            for parameter in unit.parameters():
                for name in names.get(id(parameter), []):
                    if prefix + name in state:
                        state[prefix + name] = parameter.detach()

    def local_shards(self, model: Module) -> dict[str, LocalShard]:
        """This worker's part of each sharded parameter, by state dict name: views of the slices its optimizer
        steps, or that no optimizer steps (frozen ones; all before an optimizer is set up): no gather, no
        copy. Left out: a parameter of which this worker holds no element, and those every worker holds whole
        (registered on the model itself, or frozen outside every unit)."""
        units = self._units()
        assert units is not None
        names = parameter_names(model)
        shards: dict[str, LocalShard] = {}
        for unit in units.units:
            for sharded, index in unit.pieces:
                for parameter, shard in sharded.buckets[index].local_shards(sharded.slices[index].detach()):
                    shards.update((name, shard) for name in names.get(id(parameter), []))
        return shards

    def _frozen_whole(self, names: Mapping[int, list[str]]) -> dict[str, torch.Tensor]:
        """The units' frozen parameters, whole, by state dict name, gathered one unit at a time (a collective: every
        worker commits at the same step). A commit keeps the trainable ones as slices with the optimizer parts; no
        optimizer holds the frozen ones, so the commit holds them whole (every worker: any survivor may share it)."""
        units = self._units()
        assert units is not None
        whole: dict[str, torch.Tensor] = {}
        for unit in units.units:
            frozen = [p for p in unit.parameters() if not p.requires_grad]
            if not frozen:
                continue
            was_whole = unit.whole
            unit.gather(full=True)
            for parameter in frozen:
                copy = parameter.detach().clone()
                whole.update((name, copy) for name in names.get(id(parameter), []))
            if not was_whole:
                unit.free()
        return whole

    def _owned_names(self, names: Mapping[int, list[str]]) -> set[str]:
        """The state dict names of the units' parameters (``names``: ``_parameter_names``)."""
        units = self._units()
        assert units is not None
        return {name for unit in units.units for p in unit.parameters() for name in names.get(id(p), [])}


def parameter_names(model: Module) -> dict[int, list[str]]:
    """Parameter id -> every name the model's state dict gives it (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def first_key(names: Sequence[str], prefix: str, state: Mapping[str, Any]) -> str | None:
    """The first of a parameter's ``names`` (a tied weight has several) that ``state`` holds under ``prefix``."""
    return next((prefix + name for name in names if prefix + name in state), None)
