"""Gradient buckets: split by dtype and size, flattened and written back."""

from __future__ import annotations

import torch

from hvd_plugins.core.comm.buckets import bucket_tensors
from hvd_plugins.core.comm.layout import flatten, unflatten_into


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


def test_a_tensor_from_the_alone_size_up_gets_a_bucket_of_its_own_where_it_comes() -> None:
    small_a, large, small_b, larger = torch.ones(10), torch.ones(256), torch.ones(20), torch.ones(1000)
    buckets = bucket_tensors([small_a, large, small_b, larger], bucket_bytes=10_000, alone_from_bytes=256 * 4)
    # the small ones go on filling their bucket across the large ones, each large one alone in its place
    assert [[t.numel() for t in bucket] for bucket in buckets] == [[256], [1000], [10, 20]]
    assert len(bucket_tensors([small_a, large, small_b, larger], bucket_bytes=10_000)) == 1  # no alone size
