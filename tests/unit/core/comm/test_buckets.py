"""Gradient buckets: split by dtype and size, flattened and written back."""

from __future__ import annotations

import torch

from hvd_plugins.core.comm.buckets import bucket_tensors, flatten, unflatten_into


def test_buckets_split_by_dtype_and_size_and_round_trip() -> None:
    tensors = [torch.ones(10), torch.ones(300), torch.ones(5, dtype=torch.float64), torch.ones(20)]
    buckets = bucket_tensors(tensors, bucket_bytes=400 * 4)
    assert sorted(len(b) for b in buckets) == [1, 3]
    assert all(len({t.dtype for t in bucket}) == 1 for bucket in buckets)
    small = bucket_tensors(tensors, bucket_bytes=100)
    assert len(small) == 4
    flat = flatten([tensors[0], tensors[3]]) * 2
    unflatten_into(flat, [tensors[0], tensors[3]])
    assert float(tensors[0].sum()) == 20 and float(tensors[3].sum()) == 40
