"""Wire dtypes for each reduction and the way back, and the reduction names accepted."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.comm import wire
from hvd_plugins.core.comm.wire import for_wire, from_wire, nbytes, reduce_op_name, wire_dtype


@pytest.mark.parametrize(
    ("dtype", "op", "wire", "back"),
    [
        (torch.bool, "sum", torch.int64, torch.bool),
        (torch.bool, "max", torch.int64, torch.bool),
        (torch.bool, "gather", torch.uint8, torch.bool),
        (torch.bool, "average", torch.float64, torch.float64),
        (torch.int32, "average", torch.float64, torch.float64),  # an average of integers stays a float
        (torch.int32, "sum", torch.int32, torch.int32),
        (torch.float16, "average", torch.float16, torch.float16),
        (torch.float64, "gather", torch.float64, torch.float64),
    ],
)
def test_wire_dtype_and_the_way_back(dtype: torch.dtype, op: str, wire: torch.dtype, back: torch.dtype) -> None:
    tensor = torch.ones(3, dtype=dtype)
    assert wire_dtype(dtype, op) == wire and for_wire(tensor, op).dtype == wire
    assert from_wire(for_wire(tensor, op), dtype, op).dtype == back


@pytest.mark.parametrize("takes_bfloat16", [True, False])
@pytest.mark.parametrize("op", ["sum", "average", "gather"])
def test_bfloat16_travels_as_bfloat16_where_horovod_takes_it(
    takes_bfloat16: bool, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build with the bfloat16 patches sends bfloat16 as it is; Horovod 0.28.1 as float32 (half the bytes lost)."""
    monkeypatch.setattr(wire, "takes_bfloat16", lambda hvd: takes_bfloat16)
    monkeypatch.setattr(wire, "horovod_torch", lambda: None)
    tensor = torch.ones(3, dtype=torch.bfloat16)
    expected = torch.bfloat16 if takes_bfloat16 else torch.float32
    assert wire_dtype(torch.bfloat16, op) == expected and for_wire(tensor, op).dtype == expected
    assert from_wire(for_wire(tensor, op), torch.bfloat16, op).dtype == torch.bfloat16


def test_reduce_op_names_accept_aliases_and_enums_only() -> None:
    assert [reduce_op_name(op) for op in (None, "mean", "AVG", "sum", "max", "min")] == [
        "average", "average", "average", "sum", "max", "min"]  # fmt: skip
    assert reduce_op_name(torch.distributed.ReduceOp.SUM) == "sum"
    with pytest.raises(ValueError, match=r"reduce_op='product' is not supported; choose one of \['average', 'avg'"):
        reduce_op_name("product")
    assert nbytes(torch.zeros(3, 4, dtype=torch.float16)) == 24
