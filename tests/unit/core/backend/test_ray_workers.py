"""What the Ray launch decides as its actors start: their ranks and variables."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hvd_plugins.core.backend.ray_workers import host_plan, worker_environment


def test_actors_are_ranked_node_by_node_with_the_nodes_local_and_cross_ranks() -> None:
    order, slots = host_plan(["b", "a", "b", "a", "c"])  # the node each actor landed on
    assert order == [0, 2, 1, 3, 4]  # node b's actors, then a's, then c's
    ranked = [(slot.rank, slot.local_rank, slot.local_size, slot.cross_rank, slot.cross_size) for slot in slots]
    assert ranked == [(0, 0, 2, 0, 3), (1, 1, 2, 0, 2), (2, 0, 2, 1, 3), (3, 1, 2, 1, 2), (4, 0, 1, 2, 3)]


def test_each_worker_gets_the_variables_horovodrun_gives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [key for key in os.environ if key.startswith(("HOROVOD_", "NCCL_", "HVD_PLUGINS_"))]:
        monkeypatch.delenv(key)
    slot = SimpleNamespace(
        hostname="ray-node-1", rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2
    )
    environment = worker_environment(slot, "10.0.0.5", 4242, "eth0")
    assert environment["HOROVOD_RANK"] == "3" and environment["HOROVOD_CROSS_RANK"] == "1"
    assert environment["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.5"
    assert environment["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4242" and environment["HOROVOD_CONTROLLER"] == "gloo"
    assert environment["HOROVOD_GLOO_IFACE"] == "eth0" and environment["NCCL_SOCKET_IFNAME"] == "eth0"
    # the driver's own settings reach every actor (actors inherit the raylet's environment, not the driver's)
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "ib0")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    environment = worker_environment(slot, "10.0.0.5", 4242, "eth0")
    assert environment["HOROVOD_GLOO_IFACE"] == "ib0" and environment["NCCL_SOCKET_IFNAME"] == "ib0"
    assert environment["HOROVOD_FUSION_THRESHOLD"] == "0" and environment["NCCL_DEBUG"] == "INFO"
    assert environment["HOROVOD_RANK"] == "3"  # the plan's, whatever the driver has
