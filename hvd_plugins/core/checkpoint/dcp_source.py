"""One part of a DCP checkpoint (the model, or one optimizer), read where it is needed and no more of it.

Every worker of a sharded job needs only its slices of a sharded tensor. ``DcpSource`` names one top-level key
of a DCP directory (``model``, ``optimizer_0``, ...) and reads into the destinations a sharded mode gives
(``read_into``): views of the slices this worker holds (``FlatPieces``), or the live tensors of what it holds
whole. DCP then reads from the shard files only the boxes that overlap them, whatever the world size that saved
it, so a worker holds no more of the checkpoint than it keeps. What is small (an optimizer's param groups and step
counts) is read whole (``read``). The Trainer's checkpoint dict carries a ``DcpSource`` in place of its model
and optimizer states until the strategy loads them, as Lightning's FSDP loads a sharded checkpoint in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from hvd_plugins.core.checkpoint.boxes import FlatPieces

Path_ = tuple[str, ...]
"""Where an entry sits under the source's key: ``("blocks.0.weight",)``, ``("state", name, "exp_avg")``."""


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also reads into a ``FlatPieces``' boxes, and names a tensor whose saved
    shape differs from the one it is read into."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        """As DCP's, without its pass that makes meta tensors real, which turns any other object into None."""
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, FlatPieces):
            assert index.offset is not None
            return found.box_at(index.offset)
        return super().lookup_tensor(index)

    def create_local_plan(self) -> Any:
        assert self.metadata is not None
        for key, value in self.state_dict.items():
            saved = self.metadata.state_dict_metadata.get(key)
            shape = value.shard.shape if isinstance(value, FlatPieces) else getattr(value, "shape", None)
            if isinstance(saved, TensorStorageMetadata) and shape is not None and tuple(saved.size) != tuple(shape):
                raise RuntimeError(
                    f"size mismatch for {key}: the checkpoint holds {tuple(saved.size)}, the model {tuple(shape)}"
                )
        return super().create_local_plan()


class _SelectedLoadPlanner(_EmptyStateDictLoadPlanner):
    """Reads whole the entries ``include`` accepts (by their path in the saved state), nothing else."""

    def __init__(self, include: Callable[[tuple[Any, ...]], bool]) -> None:
        super().__init__()
        self.include = include

    def _should_include_key(self, key: str, metadata: Metadata) -> bool:
        return self.include(tuple((metadata.planner_data or {}).get(key, (key,))))


@dataclass(frozen=True)
class DcpSource:
    """The entries under ``key`` of the DCP directory ``path``, left on disk until loaded."""

    path: Path
    key: str

    @cached_property
    def _metadata(self) -> Metadata:
        return FileSystemReader(self.path).read_metadata()

    def entries(self) -> dict[Path_, Any]:
        """Each saved entry under the key, by its path below it: DCP's storage metadata (shape, dtype)."""
        found: dict[Path_, Any] = {}
        for flat, saved in self._metadata.state_dict_metadata.items():
            path = tuple(str(part) for part in (self._metadata.planner_data or {}).get(flat, (flat,)))
            if path[0] == self.key:
                found[path[1:]] = saved
        return found

    def read(self, include: Callable[[Path_], bool]) -> dict[str, Any]:
        """The entries ``include`` accepts, whole, nested as saved (the key itself left out)."""
        state: dict[str, Any] = {}

        def accepted(path: tuple[Any, ...]) -> bool:
            return str(path[0]) == self.key and include(tuple(str(part) for part in path[1:]))

        read_selected(FileSystemReader(self.path), state, accepted)
        found: dict[str, Any] = state.get(self.key, {})
        return found

    def read_into(self, targets: Mapping[str, Any]) -> None:
        """``targets`` (nested as saved under the key: ``FlatPieces`` and tensors) filled in place from the shard
        files, only the boxes each overlaps read; an entry the checkpoint lacks is named in the error."""
        reader = FileSystemReader(self.path)
        try:
            _load_state_dict({self.key: dict(targets)}, reader, planner=PiecesLoadPlanner(), no_dist=True)
        except CheckpointException as error:  # a BaseException wrapping what failed: raise that itself
            causes = [c[0] if isinstance(c, tuple) else c for c in getattr(error, "failures", {}).values()]
            cause = causes[0] if causes and isinstance(causes[0], Exception) else None
            if cause is None:
                raise
            raise type(cause)(str(cause)) from None


def read_selected(reader: FileSystemReader, into: dict[str, Any], include: Callable[[tuple[Any, ...]], bool]) -> None:
    """The entries ``include`` accepts (by their saved path), read whole into ``into``, nested as saved."""
    _load_state_dict(into, reader, planner=_SelectedLoadPlanner(include), no_dist=True)


def is_shaped(saved: Any) -> bool:
    """Whether a saved entry is a tensor with elements along dimensions (not a scalar, not pickled bytes)."""
    return isinstance(saved, TensorStorageMetadata) and len(saved.size) > 0


def read_model(source: DcpSource, targets: dict[str, Any], strict: bool, model_name: str) -> None:
    """A model's state read in place into ``targets`` (its live tensors, or this worker's pieces of them); with
    ``strict``, names that only one side holds are named first, as ``load_state_dict`` names them."""
    saved = {path[0] for path in source.entries()}
    missing, unexpected = sorted(set(targets) - saved), sorted(saved - set(targets))
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {model_name}: missing keys {missing[:6]}, unexpected keys "
            f"{unexpected[:6]} (the checkpoint's {source.key!r} is of another model)"
        )
    source.read_into({key: value for key, value in targets.items() if key in saved})
