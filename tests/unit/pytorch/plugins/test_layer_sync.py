"""The Trainer's layer sync under Horovod: ours in place of torch's, refused with DASO."""

from __future__ import annotations

import pytest
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

from hvd_plugins.pytorch.plugins.layer_sync import HorovodSyncBatchNorm, horovod_layer_sync


@pytest.mark.parametrize("sync", ["allreduce", "hierarchical"])
def test_torch_sync_batchnorm_is_replaced_by_horovods(sync: str) -> None:
    assert isinstance(horovod_layer_sync(TorchSyncBatchNorm(), sync), HorovodSyncBatchNorm)


def test_no_layer_sync_stays_none_under_every_sync() -> None:
    for sync in ("allreduce", "hierarchical", "daso"):
        assert horovod_layer_sync(None, sync) is None


@pytest.mark.parametrize("given", [TorchSyncBatchNorm(), HorovodSyncBatchNorm()])
def test_daso_with_synchronized_batchnorm_is_refused_naming_both_and_the_ways_out(given: object) -> None:
    with pytest.raises(ValueError, match="sync='daso'") as raised:
        horovod_layer_sync(given, "daso")  # type: ignore[arg-type]
    message = str(raised.value)
    assert "sync_batchnorm=True" in message and "sync='hierarchical'" in message
