"""make_gradient_sync: the gradient sync each ``sync``, ``op`` and ``hierarchical_impl`` stands for.

One rank of a pretend job on two nodes of two workers (FakeHorovod); the node layout the node-aware
modes gather is handed in, and counted, since gathering it is a collective.
"""

from __future__ import annotations

import pytest

from hvd_plugins.core.comm import world
from hvd_plugins.core.comm.compression import FP16Compression, NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.topology import Topology
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.sync import table as sync_modes
from hvd_plugins.core.sync.bucketed import BucketedAllreduceSync
from hvd_plugins.core.sync.daso.config import DasoConfig
from hvd_plugins.core.sync.daso.mode import DasoGradientSync
from hvd_plugins.core.sync.flat import AdasumOptimizerSync, HorovodOptimizerSync
from hvd_plugins.core.sync.hierarchical.mode import HierarchicalGradientSync
from hvd_plugins.core.sync.table import make_gradient_sync

TWO_BY_TWO = Topology(rank=1, nodes=((0, 1), (2, 3)))


@pytest.fixture
def layouts_gathered(fake_horovod, monkeypatch: pytest.MonkeyPatch) -> list[Topology]:
    """Each node layout make_gradient_sync gathered; a job of two nodes (cross_size 2)."""
    fake_horovod(world, size=4, rank=1, cross_size=2)
    gathered: list[Topology] = []
    monkeypatch.setattr(sync_modes, "discover_topology", lambda: gathered.append(TWO_BY_TWO) or TWO_BY_TWO)
    return gathered


@pytest.mark.parametrize(
    ("settings", "expected", "op"),
    [
        ({}, BucketedAllreduceSync, "average"),
        ({"op": "sum"}, BucketedAllreduceSync, "sum"),
        ({"gradient_predivide_factor": 2.0}, HorovodOptimizerSync, "average"),
        ({"sparse_as_dense": True}, HorovodOptimizerSync, "average"),
        ({"op": "adasum"}, AdasumOptimizerSync, "adasum"),
        ({"sync": "hierarchical"}, HierarchicalGradientSync, "average"),
        ({"sync": "hierarchical", "op": "sum"}, HierarchicalGradientSync, "sum"),
        ({"sync": "hierarchical", "hierarchical_impl": "native"}, HorovodOptimizerSync, "average"),
        ({"sync": "daso"}, DasoGradientSync, "average"),
    ],
    ids=[
        "allreduce",
        "allreduce-sum",
        "predivide",
        "sparse-as-dense",
        "allreduce-adasum",
        "hierarchical",
        "hierarchical-sum",
        "native",
        "daso",
    ],
)
def test_each_setting_gets_its_sync(layouts_gathered: list[Topology], settings: dict, expected: type, op: str) -> None:
    sync = make_gradient_sync(HorovodConfig(**settings), CommCounters())
    assert type(sync) is expected
    assert sync.op == op
    node_aware = expected in (HierarchicalGradientSync, DasoGradientSync)
    assert layouts_gathered == ([TWO_BY_TWO] if node_aware else [])  # only node-aware modes gather the layout
    assert sync.topology is (TWO_BY_TWO if node_aware else None)


def test_the_flat_sync_counts_its_bytes_as_crossing_nodes_only_when_there_are_several(
    fake_horovod,
) -> None:
    counters = CommCounters()
    for cross_size, scope in ((2, Scope.CROSS_NODE), (1, Scope.NODE_LOCAL)):
        fake_horovod(world, size=2, cross_size=cross_size)
        sync = make_gradient_sync(HorovodConfig(compression="fp16", gradient_predivide_factor=2.0), counters)
        assert sync.compressor.scope is scope and sync.compressor.counters is counters
        assert isinstance(sync.compressor.inner, FP16Compression)
        assert sync.gradient_predivide_factor == 2.0


def test_node_aware_syncs_take_the_configs_settings(layouts_gathered: list[Topology]) -> None:
    config = HorovodConfig(sync="hierarchical", compress_node_local=True, bucket_mb=2.0, flat_below_mb=0.5)
    hierarchical = make_gradient_sync(config, CommCounters())
    assert isinstance(hierarchical, HierarchicalGradientSync)
    assert hierarchical.compress_node_local and isinstance(hierarchical.compressor, NoCompression)
    assert (hierarchical.bucket_bytes, hierarchical.flat_below_bytes) == (2 * 2**20, 2**19)
    assert not hierarchical.tune_route  # a fixed threshold: no route timing
    assert make_gradient_sync(HorovodConfig(sync="hierarchical"), CommCounters()).tune_route  # "auto" times both
    daso_config = DasoConfig(warmup_epochs=2, downcast="fp32")
    daso = make_gradient_sync(HorovodConfig(sync="daso", daso=daso_config, compression="fp16"), CommCounters())
    assert isinstance(daso, DasoGradientSync) and daso.config == daso_config
    assert isinstance(daso.node_compressor, FP16Compression) and isinstance(daso.global_compressor, NoCompression)
    assert daso.groups.topology is TWO_BY_TWO
