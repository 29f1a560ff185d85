"""Which tensors share a bucket: by dtype and device, up to a size (``comm.layout`` lays each bucket out flat)."""

from __future__ import annotations

from collections.abc import Iterable

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
