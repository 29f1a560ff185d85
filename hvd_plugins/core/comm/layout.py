"""One flat layout: where each of a few tensors lies in one flat vector, and this worker's slice of it.

Every mode that puts many tensors into one collective lays them out here: the flat buckets, the two-level
and DASO sums, the ZeRO-1/2/3 slices and the units' gathered buffers, elastic commits and parts checkpoints.
``FlatLayout.__init__`` is the package's one walk over the offsets; everything else asks the layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import accumulate

import torch

from hvd_plugins.core.comm.shards import ShardLayout


class FlatLayout:
    """Tensors of ``shapes`` end to end in one flat vector, padded to ``parts`` equal slices; this worker owns
    slice ``index`` (``shard``). Tensor ``i`` is elements ``offsets[i]`` to ``offsets[i] + numels[i]``."""

    __slots__ = ("shapes", "numels", "offsets", "numel", "shard")

    def __init__(self, shapes: Sequence[torch.Size], parts: int = 1, index: int = 0) -> None:
        self.shapes: tuple[torch.Size, ...] = tuple(torch.Size(shape) for shape in shapes)
        self.numels: tuple[int, ...] = tuple(shape.numel() for shape in self.shapes)
        ends = tuple(accumulate(self.numels))
        self.offsets: tuple[int, ...] = (0, *ends[:-1]) if ends else ()
        self.numel: int = ends[-1] if ends else 0
        self.shard = ShardLayout(self.numel, parts, index)

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], parts: int = 1, index: int = 0) -> FlatLayout:
        """The layout of ``tensors`` as they are now."""
        return cls([tensor.shape for tensor in tensors], parts, index)

    def __len__(self) -> int:
        return len(self.shapes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatLayout) and (self.shapes, self.shard) == (other.shapes, other.shard)

    def __hash__(self) -> int:
        return hash((self.shapes, self.shard))

    @property
    def padded_numel(self) -> int:
        """The flat vector's length, padding included."""
        return self.shard.padded_numel

    def spans(self) -> Iterator[tuple[int, int, torch.Size]]:
        """Each tensor's (offset, element count, shape), in order."""
        return zip(self.offsets, self.numels, self.shapes, strict=True)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor as a view of ``flat`` (at least ``numel`` long), in its shape."""
        return [flat[offset : offset + count].view(shape) for offset, count, shape in self.spans()]

    def new_flat(self, like: torch.Tensor, padded: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised flat vector on ``like``'s device (``padded``: with room for every slice)."""
        length = self.padded_numel if padded else self.numel
        return torch.empty(length, dtype=dtype or like.dtype, device=like.device)

    def pack(
        self, tensors: Sequence[torch.Tensor | None], into: torch.Tensor | None = None, padded: bool = False
    ) -> torch.Tensor:
        """``tensors`` (None as zeros) end to end in ``into`` (else a new vector, ``padded`` or not), zeros after."""
        if into is None:
            first = next(tensor for tensor in tensors if tensor is not None)
            into = self.new_flat(first, padded)
        for view, tensor in zip(self.views(into), tensors, strict=True):
            if tensor is None:
                view.zero_()
            else:
                view.copy_(tensor.reshape(view.shape))
        into[self.numel :].zero_()
        return into

    def unpack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``flat``'s parts into ``tensors`` (each in its own dtype)."""
        for view, tensor in zip(self.views(flat), tensors, strict=True):
            tensor.copy_(view.view_as(tensor))

    def overlaps(self, index: int | None = None) -> list[tuple[int, slice, slice]]:
        """For each tensor that overlaps slice ``index`` (this worker's by default): (its position, its elements in
        the slice, where they lie in the slice)."""
        begin = (self.shard.index if index is None else index) * self.shard.shard_numel
        end = begin + self.shard.shard_numel
        found = []
        for position, (offset, count, _) in enumerate(self.spans()):
            low, high = max(offset, begin), min(offset + count, end)
            if low < high:
                found.append((position, slice(low - offset, high - offset), slice(low - begin, high - begin)))
        return found

    def read_slice(self, tensors: Sequence[torch.Tensor | None], into: torch.Tensor) -> torch.Tensor:
        """This worker's slice of ``tensors`` laid out flat (None as zeros), into ``into``; no whole vector is built."""
        into.zero_()
        for position, part, place in self.overlaps():
            tensor = tensors[position]
            if tensor is not None:
                into[place].copy_(tensor.reshape(-1)[part])
        return into

    def write_slice(self, values: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this worker's slice ``values`` into the matching parts of ``tensors``."""
        for position, part, place in self.overlaps():
            tensors[position].view(-1)[part].copy_(values[place])

    def write_slices(self, slices: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
        """Copy every worker's slice (``slices``, in slice order: an allgather's pieces) into the matching parts of
        ``tensors``: the whole vector is never built."""
        for index, values in enumerate(slices):
            for position, part, place in self.overlaps(index):
                tensors[position].view(-1)[part].copy_(values[place])

    def slice_views(self, values: torch.Tensor) -> list[tuple[int, torch.Tensor, int]]:
        """This worker's slice ``values`` cut by tensor: (position, the view of ``values``, where it starts in the
        tensor flattened)."""
        return [(position, values[place], part.start) for position, part, place in self.overlaps()]

    def shard_views(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's part of this worker's slice ``values``, as a 1-D view of it (empty where none lies there)."""
        views = [values[:0] for _ in self.shapes]
        for position, _, place in self.overlaps():
            views[position] = values[place]
        return views

    def at_views(self, tensors: Sequence[torch.Tensor | None], flat: torch.Tensor) -> list[bool]:
        """Which of ``tensors`` already are the views of ``flat`` this layout gives (same memory, same shape)."""
        return [
            tensor is not None
            and tensor.shape == shape
            and tensor.is_contiguous()
            and tensor.dtype == flat.dtype
            and tensor.device == flat.device
            and tensor.data_ptr() == flat.data_ptr() + offset * flat.element_size()
            for tensor, (offset, _, shape) in zip(tensors, self.spans(), strict=True)
        ]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` end to end in a new flat vector."""
    return FlatLayout.of(tensors).pack(tensors)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive parts of ``flat`` back into ``tensors``."""
    FlatLayout.of(tensors).unpack(flat, tensors)
