"""This worker's part of a tensor as torch's distributed checkpointing (DCP) stores shards: n-d boxes.

A sharded mode holds each tensor it splits as a flat range of the tensor's elements (``LocalShard``): a slice
of a flat bucket may start and end inside a row. DCP describes a shard as boxes of the tensor (an offset and a
size per dimension, ``ChunkStorageMetadata``), so a flat range is cut into the fewest row-aligned boxes that
cover it exactly (``flat_range_boxes``): a part of its first row, the whole rows, a part of its last row, each
cut again along the next dimension. Every worker's boxes together tile the tensor, which is what DCP checks
before it writes, and what lets FSDP2 (or any world size here) read the boxes it needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hvd_plugins.core.comm.shards import LocalShard

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A box of a tensor: its offset and its size along every dimension."""


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes, in element order, that cover elements ``start`` to ``stop`` (exclusive) of a tensor of ``shape``
    flattened in row-major order."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]  # a scalar: its one element
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner_shape = tuple(shape[1:])
    row = math.prod(inner_shape)
    if row == 0:
        return []
    boxes: list[Box] = []
    if start % row:  # a part of the first row
        first = start // row
        end = min(stop, (first + 1) * row)
        boxes += _in_row(first, flat_range_boxes(inner_shape, start - first * row, end - first * row))
        start = end
    whole_rows = (stop // row) * row
    if start < whole_rows:
        boxes.append(((start // row, *(0 for _ in inner_shape)), ((whole_rows - start) // row, *inner_shape)))
        start = whole_rows
    if start < stop:  # a part of the last row
        last = start // row
        boxes += _in_row(last, flat_range_boxes(inner_shape, 0, stop - last * row))
    return boxes


def _in_row(row: int, boxes: list[Box]) -> list[Box]:
    return [((row, *offsets), (1, *sizes)) for offsets, sizes in boxes]


@dataclass(frozen=True)
class FlatPieces:
    """This worker's part of one tensor (``LocalShard``: flat values from ``start``) in the form DCP saves and
    loads: DCP asks it for its write items (``__create_write_items__``) or the chunks to read into
    (``__create_chunk_list__``) and, through the planners, for each box's values."""

    shard: LocalShard

    def boxes(self) -> list[tuple[Box, torch.Tensor]]:
        """Each box with its values: views of the shard's flat values, shaped as the box."""
        shard, found = self.shard, []
        at = 0
        for offsets, sizes in flat_range_boxes(shard.shape, shard.start, shard.start + shard.values.numel()):
            count = math.prod(sizes)
            found.append(((offsets, sizes), shard.values[at : at + count].view(sizes)))
            at += count
        return found

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        """DCP's write items: one per box (DCP is imported here: only a save needs it)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self.shard.values)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=properties,
                    size=torch.Size(self.shard.shape),
                ),
            )
            for (offsets, sizes), _ in self.boxes()
        ]

    def __create_chunk_list__(self) -> list[Any]:
        """DCP's chunks of this part (a load reads the saved boxes that overlap them)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for (offsets, sizes), _ in self.boxes()
        ]

    def box_at(self, offsets: Sequence[int]) -> torch.Tensor:
        """The values of the box that starts at ``offsets``."""
        wanted = tuple(offsets)
        for (start, _), values in self.boxes():
            if start == wanted:
                return values
        raise KeyError(f"this worker holds no box of the tensor at offset {wanted}")
