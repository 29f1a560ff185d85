"""DASO's cross-node parameter syncer: what it averages, and which node pairs it can shard over."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.comm.partners import PartnerGroup
from hvd_plugins.core.comm.topology import NodeGroups, Topology, build_node_groups
from hvd_plugins.core.sync.daso.parameter_sync import optimizer_state_to_average


def test_optimizer_state_to_average_takes_only_state_living_with_its_parameter() -> None:
    """Adam's ``step`` (a CPU scalar even for GPU parameters) and state elsewhere are never flattened."""
    weight = torch.nn.Parameter(torch.ones(3, 2))
    bias = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([weight, bias])
    moment = torch.full((3, 2), 0.5)
    optimizer.state[weight] = {
        "step": torch.tensor(7.0),
        "exp_avg": moment,
        "elsewhere": torch.zeros(3, 2, device="meta"),  # another device, as CUDA moments beside a CPU step
        "wrong_shape": torch.zeros(6),
        "counts": torch.zeros(3, 2, dtype=torch.int64),
    }
    optimizer.state[bias] = {"step": torch.tensor(7.0), "exp_avg_sq": torch.full((2,), 0.25, dtype=torch.float64)}
    picked = optimizer_state_to_average([optimizer])
    assert [tuple(t.shape) for t in picked] == [(3, 2), (2,)]
    assert picked[0] is moment and picked[1].dtype == torch.float64  # another dtype is cast on the wire
    assert torch.cat([t.reshape(-1).float() for t in picked]).tolist() == [0.5] * 6 + [0.25] * 2


def test_daso_sharding_takes_only_cross_node_pairs_whose_sum_ends_in_the_wire_type() -> None:
    """The merge gathers the cross-node sum in its wire type: a relaying pair's sum is in it, an exchanging
    pair's (float32 of two float16 pieces) is not, and gathering that would round it."""
    from hvd_plugins.core.sync.daso.parameter_sync import CrossNodeSharding

    groups = build_node_groups(Topology(rank=0, nodes=((0, 1), (2, 3))))
    assert groups.cross is not None and groups.cross.relays
    CrossNodeSharding(groups, CommCounters(), chunk_numel=1024)  # the groups the strategy builds
    exchanging = NodeGroups(groups.topology, groups.local, PartnerGroup((0, 2), 0, 4), groups.world)
    with pytest.raises(ValueError, match=r"cross-node pair \(0, 2\) must relay"):
        CrossNodeSharding(exchanging, CommCounters(), chunk_numel=1024)
