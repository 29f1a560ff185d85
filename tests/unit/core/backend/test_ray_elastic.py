"""What the elastic Ray driver sees of the cluster: the live nodes, as Horovod hosts with their slots."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hvd_plugins.core.backend import ray_elastic
from hvd_plugins.core.backend.ray_elastic import host_name, ray_node_slots, slots_on


def test_a_node_holds_as_many_workers_as_its_scarcest_resource_allows() -> None:
    assert slots_on({"CPU": 8.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 1.0}) == 2
    assert slots_on({"CPU": 7.0}, {"CPU": 2.0}) == 3
    assert slots_on({"CPU": 8.0}, {"CPU": 1.0, "fast_disk": 1.0}) == 0  # a resource the node lacks


def test_live_nodes_that_hold_a_worker_are_hosts_named_by_their_node_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = [
        {"NodeID": "a" * 56, "Alive": True, "Resources": {"CPU": 4.0}},
        {"NodeID": "b" * 56, "Alive": False, "Resources": {"CPU": 4.0}},  # left the cluster
        {"NodeID": "c" * 56, "Alive": True, "Resources": {"CPU": 1.0}},  # holds no worker of 2 CPUs
        {"NodeID": "d" * 56, "Alive": True, "Resources": {"CPU": 2.0}},
    ]
    monkeypatch.setattr(ray_elastic, "import_ray", lambda: SimpleNamespace(nodes=lambda: nodes))
    slots, node_ids = ray_node_slots({"CPU": 2.0})
    assert slots == {host_name("a" * 56): 2, host_name("d" * 56): 1}
    assert node_ids[host_name("d" * 56)] == "d" * 56
    assert host_name("a" * 56) != host_name("a" * 15 + "b" * 41)  # nodes of one machine share its address


def test_a_job_that_never_grows_is_offered_only_its_first_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = [{"NodeID": "a" * 56, "Alive": True, "Resources": {"CPU": 2.0}}]
    monkeypatch.setattr(ray_elastic, "import_ray", lambda: SimpleNamespace(nodes=lambda: nodes))
    discovery = ray_elastic._discovery({"CPU": 1.0})
    discovery.keep_only({host_name("a" * 56)})
    nodes.append({"NodeID": "b" * 56, "Alive": True, "Resources": {"CPU": 2.0}})  # a node joins the cluster
    assert discovery.find_available_hosts_and_slots() == {host_name("a" * 56): 2}
    assert discovery.node_of(host_name("a" * 56)) == "a" * 56
