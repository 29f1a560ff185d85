"""``ShardedGradientSync`` on two nodes of two workers, each a thread (``ThreadedJob``): sharded inside the node
(``sync="hierarchical"``) trains the same parameters as sharded over every worker and as unsharded, holds half
the optimizer state per worker (L = 2), and sends no more across nodes than over every worker.

Small integer inputs and weights in float64 and a power-of-two learning rate keep every sum exact in any
order, so the runs are compared for equality.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hvd_plugins.core.comm.compression import NoCompression
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.comm.topology import build_node_groups, discover_topology
from hvd_plugins.core.sync.hierarchical.mode import HierarchicalGradientSync
from hvd_plugins.core.sync.sharded.mode import ShardedGradientSync
from unit.integer_training import integer_inputs, integer_model, train_synced
from unit.threaded_horovod import RankHorovod, ThreadedJob

STEPS = 3
LR = 0.25


def rank_data(rank: int, step: int) -> torch.Tensor:
    return integer_inputs(rank, step, rows=4, features=3, bound=2)


def unsharded(model: nn.Module, size: int) -> list[torch.Tensor]:
    """SGD with momentum on the average of every rank's gradients, in one process."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(size):
            (model(rank_data(rank, step)).sum() / size).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_inside_the_node_trains_as_over_every_worker_with_half_the_state(
    monkeypatch: pytest.MonkeyPatch, shard: str
) -> None:
    job = ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)
    model = integer_model(3, 5, 2)
    expected = unsharded(model, job.size)

    def train(hvd: RankHorovod, inside_node: bool) -> tuple[list[torch.Tensor], int, CommCounters, list[float]]:
        mine, counters = copy.deepcopy(model), CommCounters()
        groups = build_node_groups(discover_topology()) if inside_node else None
        sync = ShardedGradientSync(shard, NoCompression(), "average", counters, bucket_bytes=64, node_groups=groups)
        optimizer = sync.wrap(torch.optim.SGD(mine.parameters(), lr=LR, momentum=0.5), list(mine.named_parameters()))
        norms = []
        for step in range(STEPS):
            optimizer.zero_grad()
            sync.before_backward(optimizer)
            mine(rank_data(hvd.rank(), step)).sum().backward()
            sync.synchronize(optimizer)
            norms.append(float(sync.clip_grad_norm_(optimizer, max_norm=1e9)))  # the whole gradient's norm
            optimizer.step()
        state = sync.optimizer_state_bytes()
        whole = optimizer.state_dict()  # consolidated: a collective inside the node
        assert len(whole["state"]) == len(list(mine.parameters()))
        sync.teardown([optimizer])
        return [p.detach().clone() for p in mine.parameters()], state, counters, norms

    flat = job.run(lambda hvd: train(hvd, inside_node=False))
    hybrid = job.run(lambda hvd: train(hvd, inside_node=True))
    for (params, _, _, norms), (hybrid_params, _, _, hybrid_norms) in zip(flat, hybrid, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(hybrid_params, expected, strict=True))
        assert hybrid_norms == pytest.approx(norms, rel=1e-12)  # each slice's share counted once, not per node
    numel = sum(p.numel() for p in model.parameters())
    momentum_bytes = numel * 8
    assert max(state for _, state, _, _ in flat) <= momentum_bytes / 4 + 64  # padding of the buckets
    assert all(momentum_bytes / 2 <= state <= momentum_bytes / 2 + 64 for _, state, _, _ in hybrid)
    two_level = job.run(lambda hvd: hierarchical_cross_node_bytes(model, hvd))
    sent = [counters.cross_node_bytes for _, _, counters, _ in hybrid]
    assert all(0 < mine <= want for mine, want in zip(sent, two_level, strict=True)), (sent, two_level)


def hierarchical_cross_node_bytes(model: nn.Module, hvd: RankHorovod) -> int:
    """What ``sync="hierarchical"`` (unsharded) sends across nodes for the same steps."""
    mine, counters = copy.deepcopy(model), CommCounters()
    groups = build_node_groups(discover_topology())
    sync = HierarchicalGradientSync(groups, NoCompression(), "average", counters, bucket_bytes=64, tune_route=False)
    optimizer = sync.wrap(torch.optim.SGD(mine.parameters(), lr=LR, momentum=0.5), list(mine.named_parameters()))
    train_synced(sync, optimizer, mine, lambda step: rank_data(hvd.rank(), step), STEPS)
    sync.teardown([optimizer])
    return counters.cross_node_bytes
