"""The user's optimizer stepping only this worker's slices, its parameters gathered again after every step.

``ShardedOptimizer`` stands where the user's optimizer stood (Lightning, LR schedulers and clipping
see its ``param_groups``: the whole parameters and the hyper-parameters a scheduler changes). Inside,
an optimizer of the user's class holds one flat parameter per bucket, this worker's slice
(``partition``), so its state (Adam's moments, SGD's momentum) is 1/N of the unsharded state. A step
copies the hyper-parameters in, steps the slices, and allgathers the updated slices into the
parameters, so every worker holds the whole model again.

Its ``state_dict`` is the consolidated state, in the format of the user's optimizer (a collective:
every worker must call it, as Lightning's and Fabric's checkpoint saving do): a checkpoint loads into
an unsharded optimizer, a single process, or a sharded job of another size. ``load_state_dict`` takes
such a state (from any world size, sharded or not) and keeps this worker's slices of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Parameter
from torch.optim import Optimizer

from hvd_plugins.core.checkpoint.boxes import FlatPieces
from hvd_plugins.core.checkpoint.dcp_source import DcpSource
from hvd_plugins.core.checkpoint.dcp_source import is_shaped as is_saved_shaped
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.in_flight import InFlight, finish_each
from hvd_plugins.core.comm.partners import PartnerGroup, start_slices_gather
from hvd_plugins.core.comm.wire import nbytes
from hvd_plugins.core.sync.parts import PART_FORMAT
from hvd_plugins.core.sync.sharded.partition import ShardedBucket, Signature
from hvd_plugins.core.sync.sharded.slices import BucketSlices

WHOLE_TENSOR_OPTIMIZERS: tuple[type[Optimizer], ...] = (torch.optim.LBFGS, torch.optim.SparseAdam)
"""Optimizers that need whole parameters (a line search over the whole model, sparse state): refused.
Mark any other such optimizer with ``optimizer.hvd_plugins_whole_tensors = True``."""


def refuse_whole_tensor_optimizer(optimizer: Optimizer, shard: str) -> None:
    """Sharding steps slices of flat buckets: an optimizer that needs whole tensors cannot step them."""
    if isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS) or getattr(optimizer, "hvd_plugins_whole_tensors", False):
        raise ValueError(
            f"shard={shard!r} cannot shard {type(optimizer).__name__}: it needs whole parameters, and a sharded "
            "worker steps a flat slice of each bucket. Use an elementwise optimizer (SGD, Adam, AdamW, RMSprop, "
            "Adagrad, ...), or shard='none'."
        )


def constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its class's constructor takes (``AdamW`` keeps one in ``defaults`` it does not take;
    every group carries all of them anyway)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


class ShardedOptimizer(BucketSlices, Optimizer):
    """``optimizer`` over this worker's slices of ``buckets`` (``BucketSlices``); see the module docstring.

    ``gradients_from_parameters``: take each slice's gradient from the averaged gradients of the whole
    parameters at the step (ZeRO-1); otherwise the sync mode hands each slice its gradient (ZeRO-2).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        buckets: Sequence[ShardedBucket],
        world: PartnerGroup | None,
        counters: CommCounters,
        scope: Scope,
        name: str,
        gradients_from_parameters: bool,
    ) -> None:
        Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.user_optimizer = optimizer
        self.gradients_from_parameters = gradients_from_parameters
        self.inner: Optimizer | None = None
        self._parked: dict[int, tuple[Parameter, dict[str, Any]]] = {}
        """Whole state of parameters in no bucket (frozen after they trained), kept until they train again."""
        self._checked_state = False
        self.generation = 0
        """Counts steps and ``zero_grad`` calls: gradients averaged in one generation are not new in the next."""
        BucketSlices.__init__(self, buckets, world, counters, scope, name)

    def _lay_out(self) -> None:
        """Slices of the current buckets, and an optimizer of the user's class over them (no state yet)."""
        self._lay_out_slices()
        groups: list[dict[str, Any]] = []
        for index, group in enumerate(self.param_groups):
            hyper = {key: value for key, value in group.items() if key != "params"}
            slices = [s for s, bucket in zip(self.slices, self.buckets, strict=True) if bucket.group_index == index]
            if slices:
                groups.append({**hyper, "params": slices, "hvd_plugins_group": index})
        self.inner = type(self.user_optimizer)(groups, **constructor_defaults(self.user_optimizer)) if groups else None
        self._checked_state = False

    def repartition(self, lay_out: Callable[[Signature], list[ShardedBucket]]) -> None:
        """Lay the slices out anew (the trainable parameters changed), keeping the state: a collective.

        The state is consolidated over the old slices and sliced again over the new ones, so parameters
        that stay trainable keep their state, frozen ones keep theirs whole until they train again, and
        newly trainable ones start without, as unsharded. Parameters whose scalar state differs (Adam's
        step count) go to different buckets: ``lay_out(signature)`` makes them.
        """
        state = self.state_dict()
        indices = self.parameter_indices()
        saved = state["state"]

        def signature(parameter: Parameter) -> Hashable:
            values = saved.get(indices[id(parameter)], {})
            return tuple(sorted((key, scalar_of(value)) for key, value in values.items() if not is_shaped(value)))

        self.buckets = lay_out(signature)
        self._lay_out()
        self.load_state_dict(state)

    def parameter_indices(self) -> dict[int, int]:
        """Each parameter's index in a state dict: its position over the param groups, as torch numbers them."""
        return {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}

    def release_slices(self) -> None:
        super().release_slices()
        self.inner = None

    # ------------------------------------------------------------------ stepping
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.generation += 1
        if self.inner is None:
            return loss
        with torch.no_grad():
            self._refresh_slices()
            for group in self.inner.param_groups:  # a scheduler changed the outer groups
                outer = self.param_groups[group["hvd_plugins_group"]]
                group.update({key: value for key, value in outer.items() if key != "params"})
            self.inner.step()
            self._check_elementwise_state()
            if self.gradients_from_parameters:
                for piece in self.slices:
                    piece.grad = None  # copies of the whole gradients' slices (ZeRO-1): free them at once
            self.gather_parameters()
        return loss

    def _refresh_slices(self) -> None:
        """The slices from the parameters as they are now (a checkpoint restore, a callback may have changed
        them), and, for ZeRO-1, their gradients from the averaged ones."""
        for bucket, piece in zip(self.buckets, self.slices, strict=True):
            if bucket.unit is not None:
                continue  # a unit's slices are its parameters' only copy between its computations
            bucket.read_slice([p.detach() for p in bucket.parameters], piece.data)
            if self.gradients_from_parameters:
                gradients = [p.grad for p in bucket.parameters]
                if any(g is not None for g in gradients):
                    piece.grad = bucket.read_slice(gradients, torch.empty_like(piece))
                else:
                    piece.grad = None

    def gather_parameters(self) -> None:
        """Every worker's updated slices, allgathered into the whole parameters (one round for all buckets); a
        unit's parameters are gathered when the unit computes next instead."""
        world = self.world
        kept = [(index, bucket) for index, bucket in enumerate(self.buckets) if bucket.unit is None]
        if world is None or world.size == 1:
            for index, bucket in kept:
                bucket.flat.unpack(self.slices[index].detach(), bucket.parameters)
            return
        pending: list[InFlight[list[torch.Tensor]]] = []
        for index, _ in kept:
            piece = self.slices[index]
            gather = start_slices_gather(piece.detach(), world, f"{self.name}.params.{index}")
            self.counters.record(self.scope, nbytes(piece))
            pending.append(gather)
        landed = finish_each(pending)
        for _, bucket in kept:  # each bucket's pieces written into the parameters and let go before the next lands
            with self.counters.waiting():
                received = next(landed)
            bucket.flat.write_slices(received, bucket.parameters)
            del received

    def _check_elementwise_state(self) -> None:
        """After the first step: every state tensor is a scalar or has its slice's shape (else the optimizer
        is not elementwise, and sharding would have changed its update)."""
        if self._checked_state or self.inner is None:
            return
        self._checked_state = True
        for piece in self.slices:
            for key, value in self.inner.state.get(piece, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != piece.shape:
                    raise ValueError(
                        f"{type(self.user_optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} for a "
                        f"parameter of shape {tuple(piece.shape)}: it is not elementwise, and sharding cannot split "
                        "it. Use an elementwise optimizer (SGD, Adam, AdamW, ...), or shard='none'."
                    )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.generation += 1
        super().zero_grad(set_to_none)
        if self.inner is not None:
            self.inner.zero_grad(set_to_none)

    def owned_gradients(self) -> list[torch.Tensor]:
        """The slices' gradients: what this worker steps."""
        return [piece.grad for piece in self.slices if piece.grad is not None]

    def sliced_parameters(self) -> list[torch.Tensor]:
        """The slices of the parameters this worker holds only as slices (the units of ``shard="parameters"``)."""
        return [
            piece.detach() for bucket, piece in zip(self.buckets, self.slices, strict=True) if bucket.unit is not None
        ]

    def sliced_parameter_bytes(self) -> int:
        """Bytes of the parameters this worker holds only as its slices (the units of ``shard="parameters"``)."""
        return sum(nbytes(piece) for piece in self.sliced_parameters())

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this worker holds (its slices')."""
        if self.inner is None:
            return 0
        return sum(
            nbytes(value)
            for state in self.inner.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )

    # ------------------------------------------------------------------ parts
    def part(self, with_values: bool = False) -> dict[str, Any]:
        """This worker's part of the state, with the layout ``consolidate`` needs to make it whole (no collective);
        ``with_values`` adds the slices of the parameters they alone hold (a unit's, under ``shard="parameters"``)."""
        indices = self.parameter_indices()
        buckets = []
        for bucket, piece in zip(self.buckets, self.slices, strict=True):
            own = self.inner.state.get(piece, {}) if self.inner is not None else {}
            saved = {
                "group": bucket.group_index,
                "parameters": [indices[id(p)] for p in bucket.parameters],
                "shapes": [list(shape) for shape in bucket.shapes],
                "numel": bucket.layout.numel,
                "state": {key: copy_of(value) for key, value in own.items()},
            }
            if with_values and bucket.unit is not None:
                saved["values"] = piece.detach().clone()
            buckets.append(saved)
        groups = []
        for group in self.param_groups:
            saved = {key: value for key, value in group.items() if key != "params"}
            saved["params"] = [indices[id(p)] for p in group["params"]]
            groups.append(saved)
        world = self.world
        return {
            "format": PART_FORMAT,
            "rank": world.index if world is not None else 0,
            "workers": world.size if world is not None else 1,
            "param_groups": groups,
            "buckets": buckets,
            "parked": self._parked_by_index(),
        }

    def load_part(self, part: Mapping[str, Any]) -> None:
        """Take back this worker's own part (saved by this rank with the same number of workers and buckets)."""
        indices = self.parameter_indices()
        world = self.world
        rank, workers = (world.index, world.size) if world is not None else (0, 1)
        layout = [([indices[id(p)] for p in b.parameters], b.layout.numel) for b in self.buckets]
        saved = [(bucket["parameters"], bucket["numel"]) for bucket in part["buckets"]]
        if (part["rank"], part["workers"]) != (rank, workers) or layout != saved:
            raise ValueError(
                f"this optimizer part was saved by worker {part['rank']} of {part['workers']} with other buckets than "
                f"worker {rank} of {workers} has now: consolidate the checkpoint first "
                "(python -m hvd_plugins.consolidate)"
            )
        for group, saved_group in zip(self.param_groups, part["param_groups"], strict=True):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
        by_index = {index: p for p, index in ((p, indices[id(p)]) for g in self.param_groups for p in g["params"])}
        self._parked = {id(by_index[int(i)]): (by_index[int(i)], dict(v)) for i, v in part["parked"].items()}
        if self.inner is None:
            return
        for piece, bucket in zip(self.slices, part["buckets"], strict=True):
            own = {
                key: value.to(piece.device) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                for key, value in bucket["state"].items()
            }
            if own:
                self.inner.state[piece] = own

    def load_values(self, values: Mapping[int, torch.Tensor]) -> None:
        """The slices of the parameters they alone hold (a unit's) from whole ``values`` by state index: an elastic
        commit's, after a reset laid the units out over the new world."""
        if not values:
            return
        indices = self.parameter_indices()
        for bucket, piece in zip(self.buckets, self.slices, strict=True):
            if bucket.unit is None:
                continue
            wholes = [values[indices[id(p)]].to(piece.device, piece.dtype) for p in bucket.parameters]
            with torch.no_grad():
                bucket.read_slice(wholes, piece.data)

    # ------------------------------------------------------------------ consolidated state
    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, as the user's optimizer would give it (a collective on every worker)."""
        indices = self.parameter_indices()
        state: dict[int, dict[str, Any]] = {index: dict(values) for index, values in self._parked_by_index().items()}
        for bucket, whole in zip(self.buckets, self._gathered_state(), strict=True):
            for key, value in whole.items():
                laid_out = isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= bucket.flat.numel
                views = bucket.flat.views(value) if laid_out else [value] * len(bucket.parameters)
                for parameter, view in zip(bucket.parameters, views, strict=True):
                    state.setdefault(indices[id(parameter)], {})[key] = copy_of(view)
        groups = []
        for group in self.param_groups:
            saved = {key: value for key, value in group.items() if key != "params"}
            saved["params"] = [indices[id(p)] for p in group["params"]]
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    def pieces(self, names: Mapping[int, str]) -> dict[str, Any]:
        """The state as a DCP checkpoint keeps it, by parameter name (``get_optimizer_state_dict``'s layout): of each
        parameter, this worker's part of each state tensor (``FlatPieces``: views, no gather, no copy) and its
        scalars, which every worker holding a slice of its bucket holds alike (DCP writes them once)."""
        state: dict[str, dict[str, Any]] = {names[id(p)]: dict(values) for p, values in self._parked.values()}
        for bucket, piece in zip(self.buckets, self.slices, strict=True):
            own = self.inner.state.get(piece, {}) if self.inner is not None else {}
            for key, value in own.items():
                if is_shaped(value):
                    for parameter, shard in bucket.local_shards(value.detach()):
                        state.setdefault(names[id(parameter)], {})[key] = FlatPieces(shard)
                else:
                    for parameter in bucket.parameters:
                        state.setdefault(names[id(parameter)], {})[key] = copy_of(value)
        groups = []
        for group in self.param_groups:
            settings = {key: value for key, value in group.items() if key != "params"}
            groups.append({**settings, "params": [names[id(p)] for p in group["params"]]})
        return {"state": state, "param_groups": groups}

    def load_pieces(self, names: Mapping[int, str], source: DcpSource) -> None:
        """This worker's slices of the state in a DCP checkpoint (``source``, keyed by parameter name as ``pieces``
        saves it): each slice-shaped state tensor read straight into a new slice of it, only the boxes this worker
        steps; the param groups, step counts and the state of parameters in no bucket read whole (they are small)."""
        unnamed = [p for group in self.param_groups for p in group["params"] if id(p) not in names]
        if unnamed:
            raise ValueError(
                f"{type(self.user_optimizer).__name__} steps {len(unnamed)} parameter(s) that the model loaded with it "
                "does not hold: a sharded checkpoint keys optimizer state by parameter name, so load the optimizer "
                "together with the model whose parameters it steps"
            )
        entries = source.entries()
        laid_out = {id(p) for bucket in self.buckets for p in bucket.parameters}
        in_buckets = {names[key] for key in laid_out}

        def small(path: tuple[str, ...]) -> bool:
            return path[0] != "state" or path[1] not in in_buckets or not is_saved_shaped(entries[path])

        saved = source.read(small)
        self._take_param_groups(saved.get("param_groups", []), names)
        states: dict[str, dict[str, Any]] = saved.get("state", {})
        by_name = {names[id(p)]: p for group in self.param_groups for p in group["params"]}
        self._parked = {
            id(p): (p, dict(states[name])) for name, p in by_name.items() if id(p) not in laid_out and name in states
        }
        if self.inner is None:
            return
        targets: dict[str, dict[str, Any]] = {}
        for bucket, piece in zip(self.buckets, self.slices, strict=True):
            own: dict[str, Any] = {}
            for parameter in bucket.parameters:  # scalars (a step count): alike for every parameter of a bucket
                own.update((key, copy_of(value)) for key, value in states.get(names[id(parameter)], {}).items())
            shaped = {
                path[2]
                for parameter in bucket.parameters
                for path, entry in entries.items()
                if path[:2] == ("state", names[id(parameter)]) and len(path) == 3 and is_saved_shaped(entry)
            }
            for key in sorted(shaped):
                own[key] = torch.zeros(piece.shape, dtype=piece.dtype, device=piece.device)
                for parameter, shard in bucket.local_shards(own[key]):
                    targets.setdefault(names[id(parameter)], {})[key] = FlatPieces(shard)
            if own:
                self.inner.state[piece] = own
        source.read_into({"state": targets})

    def _take_param_groups(self, saved: Sequence[Mapping[str, Any]], names: Mapping[int, str]) -> None:
        """The saved param groups' settings (lr, betas, ...), each group holding the same parameters by name."""
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer state has {len(saved)} param groups, this optimizer "
                f"{len(self.param_groups)}: build the optimizer with the param groups of the run that saved it"
            )
        for index, (group, ours) in enumerate(zip(saved, self.param_groups, strict=True)):
            wanted = {names[id(p)] for p in ours["params"]}
            if set(group.get("params", [])) != wanted:
                raise ValueError(
                    f"param group {index} of the checkpoint's optimizer state holds other parameters than this "
                    f"optimizer's: missing {sorted(wanted - set(group.get('params', [])))[:3]}"
                )
            ours.update({key: value for key, value in group.items() if key != "params"})

    def _parked_by_index(self) -> dict[int, dict[str, Any]]:
        indices = self.parameter_indices()
        return {indices[key]: state for key, (_, state) in self._parked.items() if key in indices}

    def _gathered_state(self) -> list[dict[str, Any]]:
        """Per bucket, its state: slice-shaped tensors allgathered whole (padding included), scalars as they are."""
        gathered: list[dict[str, Any]] = []
        pending: list[tuple[dict[str, Any], str, InFlight[list[torch.Tensor]]]] = []
        world = self.world
        for index, piece in enumerate(self.slices):
            own = self.inner.state.get(piece, {}) if self.inner is not None else {}
            whole: dict[str, Any] = {}
            for key in sorted(own, key=str):
                value = own[key]
                if isinstance(value, torch.Tensor) and value.shape == piece.shape and value.dim() > 0:
                    if world is None or world.size == 1:
                        whole[key] = value.detach()
                    else:
                        name = f"{self.name}.state.{index}.{key}"
                        pending.append((whole, key, start_slices_gather(value.detach(), world, name)))
                else:
                    whole[key] = value
            gathered.append(whole)
        for whole, key, gather in pending:
            whole[key] = torch.cat(gather.wait())
        return gathered

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take a whole optimizer's state (saved at any world size, sharded or not): keep this worker's slices."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the optimizer state has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        by_parameter: dict[int, Mapping[str, Any]] = {}
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("the optimizer state's param groups hold other parameters than this optimizer's")
            group.update({key: value for key, value in saved.items() if key != "params"})
            for index, parameter in zip(saved["params"], group["params"], strict=True):
                if index in state_dict["state"]:
                    by_parameter[id(parameter)] = state_dict["state"][index]
        laid_out = {id(p) for bucket in self.buckets for p in bucket.parameters}
        self._parked = {
            id(p): (p, dict(by_parameter[id(p)]))
            for group in self.param_groups
            for p in group["params"]
            if id(p) in by_parameter and id(p) not in laid_out and by_parameter[id(p)]
        }
        if self.inner is None:
            return
        for bucket, piece in zip(self.buckets, self.slices, strict=True):
            states = [by_parameter.get(id(p), {}) for p in bucket.parameters]
            keys = sorted({key for state in states for key in state}, key=str)
            own: dict[str, Any] = {}
            for key in keys:
                values = [state.get(key) for state in states]
                first = next(value for value in values if value is not None)
                shaped = [
                    isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == shape
                    for v, shape in zip(values, bucket.shapes, strict=True)
                    if v is not None
                ]
                if shaped and all(shaped):
                    slice_ = torch.zeros(piece.shape, dtype=first.dtype, device=piece.device)
                    own[key] = bucket.read_slice([v if v is None else v.to(piece.device) for v in values], slice_)
                else:
                    own[key] = first.clone() if isinstance(first, torch.Tensor) else first
            if own:
                self.inner.state[piece] = own


def is_shaped(value: Any) -> bool:
    """Whether a piece of optimizer state lives with its parameter's elements (not a scalar such as a step count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def copy_of(value: Any) -> Any:
    """A piece of optimizer state as it is now (a tensor cloned, a plain value as it is)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def scalar_of(value: Any) -> Any:
    """A scalar piece of state as a plain, hashable value."""
    return value.item() if isinstance(value, torch.Tensor) else value
