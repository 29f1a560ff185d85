"""Gradient compression: fp16 on the wire, names, and the byte counts it records."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.comm.compression import (
    BF16Compression,
    CountingCompressor,
    FP16Compression,
    NoCompression,
    compressor_by_name,
)
from hvd_plugins.core.comm.counters import CommCounters, Scope


def test_fp16_compression_round_trip_halves_bytes() -> None:
    tensor = torch.linspace(-3, 3, 101, dtype=torch.float32)
    wire, ctx = FP16Compression().compress(tensor)
    assert wire.dtype == torch.float16 and wire.element_size() * wire.numel() == 2 * 101
    back = FP16Compression().decompress(wire, ctx)
    assert back.dtype == torch.float32
    assert torch.allclose(back, tensor, atol=2e-3)


def test_fp16_compression_leaves_integers_alone() -> None:
    tensor = torch.arange(10)
    wire, ctx = FP16Compression().compress(tensor)
    assert wire is tensor and FP16Compression().decompress(wire, ctx) is tensor


def test_bf16_compression_round_trip_halves_bytes_and_keeps_the_range() -> None:
    tensor = torch.tensor([1e-30, -3.0, 0.1, 7e4, 1e30], dtype=torch.float32)  # float16 loses both ends
    wire, ctx = BF16Compression().compress(tensor)
    assert wire.dtype == torch.bfloat16 and wire.element_size() * wire.numel() == 2 * 5
    back = BF16Compression().decompress(wire, ctx)
    assert back.dtype == torch.float32 and torch.all(torch.isfinite(back))
    assert torch.allclose(back, tensor, rtol=2**-8, atol=0)
    bf16 = torch.ones(3, dtype=torch.bfloat16)
    assert BF16Compression().compress(bf16)[0] is bf16  # already on the wire type


def test_compressor_by_name_rejects_unknown_names() -> None:
    assert isinstance(compressor_by_name("none"), NoCompression)
    assert isinstance(compressor_by_name("bf16"), BF16Compression)
    with pytest.raises(ValueError, match=r"compression='int8'.*\['bf16', 'fp16', 'none'\]"):
        compressor_by_name("int8")


def test_counting_compressor_records_wire_bytes() -> None:
    counters = CommCounters()
    codec = CountingCompressor(FP16Compression(), counters, Scope.CROSS_NODE)
    codec.compress(torch.zeros(1000))
    codec.compress(torch.zeros(10))
    assert counters.cross_node_bytes == 2 * 1010 and counters.cross_node_calls == 2
    assert counters.node_local_bytes == 0
