"""One part of a DCP checkpoint read in place: only the pieces asked for, and what differs named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hvd_plugins.core.checkpoint.boxes import FlatPieces
from hvd_plugins.core.checkpoint.dcp_read import read_dcp
from hvd_plugins.core.checkpoint.dcp_source import DcpSource, read_model
from hvd_plugins.core.checkpoint.dcp_write import save_dcp
from hvd_plugins.core.comm.shards import LocalShard

pytestmark = pytest.mark.unit


def test_a_source_reads_only_the_pieces_asked_for_and_names_what_differs(tmp_path: Path) -> None:
    whole = torch.arange(15.0).reshape(3, 5)
    save_dcp(tmp_path / "ckpt", {"model": {"w": whole, "b": torch.ones(2)}, "optim": {"lr": 0.5}}, {}, 0, 1)
    checkpoint = read_dcp(tmp_path / "ckpt", lazy=lambda key: key == "model")
    source = checkpoint["model"]
    assert isinstance(source, DcpSource) and checkpoint["optim"] == {"lr": 0.5}
    slice_ = torch.zeros(6)  # elements 4 to 9 of w: a part of row 0, row 1, nothing of row 2
    bias = torch.zeros(2)
    read_model(source, {"w": FlatPieces(LocalShard(slice_, 4, whole.shape)), "b": bias}, True, "Net")
    assert torch.equal(slice_, whole.flatten()[4:10]) and torch.equal(bias, torch.ones(2))
    with pytest.raises(RuntimeError, match=r"missing keys \['extra'\], unexpected keys \['b'\]"):
        read_model(source, {"w": whole.clone(), "extra": torch.zeros(1)}, True, "Net")
    with pytest.raises(RuntimeError, match=r"size mismatch for model.w: the checkpoint holds \(3, 5\), the model \(5,"):
        read_model(source, {"w": torch.zeros(5, 3), "b": bias}, True, "Net")
