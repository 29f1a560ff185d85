"""The node layout gathered from every worker, and the partner groups built on it."""

from __future__ import annotations

import pytest

from hvd_plugins.core.comm.topology import Topology, build_node_groups


def test_topology_from_gathered_pairs_handles_non_contiguous_ranks() -> None:
    # ranks 0 and 2 on node 0, ranks 1 and 3 on node 1 (round-robin placement)
    topology = Topology.from_pairs(rank=3, pairs=[(0, 0), (1, 0), (0, 1), (1, 1)])
    assert topology.nodes == ((0, 2), (1, 3))
    assert (topology.node_index, topology.local_rank, topology.local_size) == (1, 1, 2)
    assert topology.cross_ranks(0) == (0, 1) and topology.cross_ranks(1) == (2, 3)
    assert topology.equal_nodes and topology.size == 4 and topology.num_nodes == 2


def test_node_groups_name_each_workers_partners_by_local_rank() -> None:
    interleaved = Topology.from_pairs(rank=2, pairs=[(0, 0), (1, 0), (0, 1), (1, 1)])  # nodes (0, 2), (1, 3)
    groups = build_node_groups(interleaved)
    assert groups.local is not None and groups.cross is not None
    assert groups.local.ranks == (0, 2) and groups.local.index == 1
    assert groups.cross.ranks == (2, 3) and not groups.cross.spans_world
    one_per_node = build_node_groups(Topology.from_pairs(rank=0, pairs=[(0, 0), (1, 0)]))
    assert one_per_node.local is None and one_per_node.cross is not None and one_per_node.cross.spans_world
    one_node = build_node_groups(Topology.from_pairs(rank=1, pairs=[(0, 0), (0, 1)]))
    assert one_node.cross is None and one_node.local is not None and one_node.local.spans_world


def test_cross_node_pairs_relay_and_neighbouring_lanes_start_in_opposite_directions() -> None:
    two_by_two = [(0, 0), (0, 1), (1, 0), (1, 1)]  # ranks 0, 1 on node 0; ranks 2, 3 on node 1
    lane0 = build_node_groups(Topology.from_pairs(rank=2, pairs=two_by_two)).cross
    lane1 = build_node_groups(Topology.from_pairs(rank=1, pairs=two_by_two)).cross
    assert lane0 is not None and lane1 is not None and lane0.relays and lane1.relays
    assert (lane0.ranks, lane0.first_sender, lane0.partner) == ((0, 2), 0, 0)  # node 0 sends first
    assert (lane1.ranks, lane1.first_sender, lane1.partner) == ((1, 3), 3, 3)  # node 1 sends first
    local = build_node_groups(Topology.from_pairs(rank=0, pairs=two_by_two)).local
    assert local is not None and not local.relays  # inside a node a pair exchanges in one round
    one_per_node = build_node_groups(Topology.from_pairs(rank=0, pairs=[(0, 0), (1, 0)])).cross
    assert one_per_node is not None and not one_per_node.relays  # every worker: Horovod's allreduce


def test_topology_rejects_unequal_nodes_with_the_sizes() -> None:
    topology = Topology.from_pairs(rank=0, pairs=[(0, 0), (0, 1), (1, 0)])
    with pytest.raises(ValueError, match=r"same number of workers on every node.*\{0: 2, 1: 1\}"):
        topology.require_equal_nodes("sync='hierarchical'")
