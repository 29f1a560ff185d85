"""What a tensor looks like on Horovod's wire, and the one map from op names to Horovod ops.

Horovod 0.28.1 cannot reduce bfloat16 (the builds of ``hvd-build-horovod`` can) and handles bool
poorly, and averaging integers in an integer type would truncate. Every collective of the package
picks its wire dtype here, so a reduce, a gather and a metric sync treat the same tensor the same
way.
"""

from __future__ import annotations

from typing import Any

import torch

from hvd_plugins.core.backend.bfloat16 import takes_bfloat16
from hvd_plugins.core.backend.module import horovod_torch

OP_NAMES = ("average", "sum", "max", "min", "adasum")
GATHER = "gather"
"""Pass as ``op`` to the wire functions for an allgather (nothing is combined)."""

_OP_ALIASES = {"mean": "average", "avg": "average", "average": "average", "sum": "sum", "max": "max", "min": "min"}
_ENUM_NAMES = {"SUM": "sum", "AVG": "average", "MAX": "max", "MIN": "min"}


def reduce_op_name(reduce_op: object) -> str:
    """Normalise what Lightning hands ``Strategy.reduce`` to an op name of ``OP_NAMES``.

    Accepts None (average), a string (``"mean"``/``"avg"`` mean average; any case), or a
    ``ReduceOp`` enum member (torch's or Lightning's), recognised by its ``name`` so this module
    needs no Lightning import.
    """
    if reduce_op is None:
        return "average"
    if isinstance(reduce_op, str):
        key = reduce_op.lower()
    else:
        key = _ENUM_NAMES.get(getattr(reduce_op, "name", ""), "")
    if key not in _OP_ALIASES:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported; choose one of {sorted(_OP_ALIASES)}")
    return _OP_ALIASES[key]


def horovod_op(op: str) -> Any:
    """The Horovod reduction for an op name of ``OP_NAMES`` (``"average"`` -> ``hvd.Average``, ...)."""
    hvd = horovod_torch()
    ops = {"average": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min, "adasum": hvd.Adasum}
    if op not in ops:
        raise ValueError(f"op={op!r} is not a Horovod reduction; choose one of {list(OP_NAMES)}")
    return ops[op]


def wire_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in for ``op`` (a name of ``OP_NAMES``, or ``GATHER``).

    bfloat16 goes as bfloat16 where the installed Horovod takes it, else as float32; integers and
    bool under ``"average"`` go as float64 (an integer average would truncate; float64 is exact up to 2**53); bool
    goes as uint8 in a gather and as int64 in other reductions, so a sum over any number of
    workers stays exact. Everything else is sent as it is.
    """
    if dtype == torch.bfloat16:
        return dtype if takes_bfloat16(horovod_torch()) else torch.float32
    if op == "average" and not dtype.is_floating_point:
        return torch.float64
    if dtype == torch.bool:
        return torch.uint8 if op == GATHER else torch.int64
    return dtype


def for_wire(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """``tensor`` in its wire dtype for ``op`` (the tensor itself when no cast is needed)."""
    return tensor.to(wire_dtype(tensor.dtype, op))


def from_wire(result: torch.Tensor, dtype: torch.dtype, op: str) -> torch.Tensor:
    """A collective's result back in the caller's ``dtype``.

    The average of integers (or bools) is returned as the float64 it arrived in: rounding it back
    would lose what an average is for.
    """
    if op == "average" and not dtype.is_floating_point:
        return result
    return result.to(dtype)


def nbytes(tensor: torch.Tensor) -> int:
    """Payload of ``tensor`` on the wire: what the communication counters record."""
    return tensor.numel() * tensor.element_size()
