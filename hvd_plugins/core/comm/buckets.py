"""Flatten many tensors into a few same-dtype buffers and copy results back."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hvd_plugins.core.comm.wire import nbytes


def bucket_tensors(
    tensors: Iterable[torch.Tensor], bucket_bytes: int, alone_from_bytes: int | None = None
) -> list[list[torch.Tensor]]:
    """Group tensors by dtype and device into lists of at most ``bucket_bytes`` each; a tensor of at least
    ``alone_from_bytes`` (when given) gets a list of its own, where it comes, while the smaller ones go on
    filling theirs."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    for tensor in tensors:
        if alone_from_bytes is not None and nbytes(tensor) >= alone_from_bytes:
            buckets.append([tensor])
            continue
        key = (tensor.dtype, tensor.device)
        members, size = open_bucket.get(key, ([], 0))
        if members and size + nbytes(tensor) > bucket_bytes:
            buckets.append(members)
            members, size = [], 0
        members.append(tensor)
        open_bucket[key] = (members, size + nbytes(tensor))
    buckets.extend(members for members, _ in open_bucket.values() if members)
    return buckets


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``."""
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset : offset + count].view_as(tensor))
        offset += count
