"""Whether Horovod takes bfloat16, and the errors that stop a bfloat16 job on a build that cannot."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hvd_plugins.core.backend import bfloat16, build_marker, capabilities
from hvd_plugins.core.backend.bfloat16 import (
    BFloat16Unsupported,
    require_bfloat16,
    require_bfloat16_for,
    takes_bfloat16,
)
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.sync.daso.config import DasoConfig

PATCHED = SimpleNamespace(mpi_lib_v2=SimpleNamespace(horovod_torch_allreduce_async_torch_BFloat16Tensor=object()))
"""``horovod.torch`` as a build with the bfloat16 patches presents it: the extension binds BFloat16Tensor."""
UNPATCHED = SimpleNamespace(mpi_lib_v2=SimpleNamespace(horovod_torch_allreduce_async_torch_HalfTensor=object()))
"""Horovod 0.28.1 as released: no binding for BFloat16Tensor."""


def test_the_extension_tells_whether_bfloat16_goes() -> None:
    assert takes_bfloat16(PATCHED)  # type: ignore[arg-type]
    assert not takes_bfloat16(UNPATCHED)  # type: ignore[arg-type]
    assert not takes_bfloat16(SimpleNamespace())  # type: ignore[arg-type]


def test_the_error_names_what_asked_the_build_and_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / build_marker.PATCHES_MARKER
    marker.write_text("0001-cxx-standard-from-build.patch\n0008-sleeping-synchronize-wait.patch\n")
    monkeypatch.setattr(bfloat16, "applied_patches", lambda: build_marker.applied_patches(marker))
    with pytest.raises(BFloat16Unsupported) as raised:
        require_bfloat16("compression='bf16'", UNPATCHED)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "compression='bf16'" in message and "`hvd-build-horovod`" in message
    assert "patches 0001, 0008" in message and "0012-bfloat16-data-type" in message
    monkeypatch.setattr(bfloat16, "applied_patches", lambda: frozenset())
    with pytest.raises(BFloat16Unsupported, match="not built by hvd-build-horovod"):
        require_bfloat16("compression='bf16'", UNPATCHED)  # type: ignore[arg-type]
    require_bfloat16("compression='bf16'", PATCHED)  # type: ignore[arg-type]


def test_a_bfloat16_model_is_stopped_before_the_first_collective() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    require_bfloat16_for(model, UNPATCHED)  # type: ignore[arg-type]  # float32: nothing to send as bfloat16
    model.to(torch.bfloat16)
    with pytest.raises(BFloat16Unsupported, match=r"precision='bf16-true'"):
        require_bfloat16_for(model, UNPATCHED)  # type: ignore[arg-type]
    require_bfloat16_for(model, PATCHED)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"compression": "bf16"}, "compression='bf16'"),
        ({"sync": "daso", "daso": DasoConfig(downcast="bf16")}, "DasoConfig(downcast='bf16')"),
    ],
)
def test_the_strategy_refuses_bf16_wires_on_a_build_without_bfloat16(
    options: dict, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capabilities, "horovod_torch", lambda: UNPATCHED)
    config = HorovodConfig(**options)
    with pytest.raises(BFloat16Unsupported, match=re.escape(f"{what} sends bfloat16")):
        capabilities.require_build_supports(config)
    monkeypatch.setattr(capabilities, "horovod_torch", lambda: PATCHED)
    capabilities.require_build_supports(config)
