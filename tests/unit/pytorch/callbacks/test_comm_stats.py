"""CommunicationMonitor's per-epoch traffic."""

from __future__ import annotations

import pytest

from hvd_plugins.pytorch.callbacks import EpochTraffic


def test_epoch_traffic_metrics_are_means_over_workers() -> None:
    traffic = EpochTraffic(
        epoch=0,
        per_worker={
            "node_local_bytes": [2 * 2**20, 4 * 2**20],
            "node_local_calls": [3, 3],
            "cross_node_bytes": [0, 2 * 2**20],
            "cross_node_calls": [0, 1],
            "wait_seconds": [1.0, 3.0],
            "copied_bytes": [0, 2**20],
            "view_fallbacks": [0, 0],
        },
    )
    metrics = traffic.metrics()
    assert metrics["comm/node_local_bytes"] == 3 * 2**20
    assert metrics["comm/cross_node_bytes"] == 2**20
    assert metrics["comm/wait_seconds"] == 2.0
    assert metrics["comm/copied_bytes"] == 2**19
    assert metrics["comm/bandwidth_mb_per_s"] == pytest.approx(2.0)  # (3 + 1) MiB / 2 s
