"""When a job runs elastic: the settings and the launcher must agree."""

from __future__ import annotations

import pytest

from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.elastic.launch import runs_elastic


def test_elastic_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert runs_elastic(HorovodConfig()) is False
    with pytest.raises(ValueError, match="runs without horovodrun.*--host-discovery-script"):
        runs_elastic(HorovodConfig(elastic=True))
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert runs_elastic(HorovodConfig()) is True
    with pytest.raises(ValueError, match="elastic=False, but horovodrun started an elastic job"):
        runs_elastic(HorovodConfig(elastic=False))
    with pytest.raises(ValueError, match="op='adasum' does not work in an elastic job"):
        runs_elastic(HorovodConfig(op="adasum"))
    assert runs_elastic(HorovodConfig(shard="gradients")) is True  # sharded commits keep parts (sharded/replicas)
    with pytest.raises(ValueError, match="commit_every_n_steps=0 must be a whole number >= 1"):
        HorovodConfig(commit_every_n_steps=0)
    with pytest.raises(ValueError, match="elastic='yes' must be True, False or 'auto'"):
        HorovodConfig(elastic="yes")  # type: ignore[arg-type]
