"""``HierarchicalGradientSync`` on a job of two nodes of two workers, every rank a thread of this process
(``ThreadedJob``): after each rank's backward on its own data, ``synchronize`` leaves every rank the exact
average (or sum) of the four ranks' gradients, and the buckets' sums started inside backward.

The model, its inputs and its weights are small integers in float64, so every gradient is an integer and
every order of addition gives the same bits: the results are compared with the reference for equality.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hvd_plugins.core.comm.compression import NoCompression
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.comm.topology import Topology, build_node_groups, discover_topology
from hvd_plugins.core.sync.hierarchical.mode import HierarchicalGradientSync
from unit.integer_training import integer_inputs, integer_model
from unit.threaded_horovod import RankHorovod, ThreadedJob

STEPS = 2


def rank_data(rank: int, step: int) -> torch.Tensor:
    return integer_inputs(rank, step, rows=5, features=3, bound=3)


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()


def gradients(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters()]
    assert all(grad is not None for grad in grads)
    return [grad.clone() for grad in grads if grad is not None]


def reference_gradients(model: nn.Module, size: int, step: int, op: str) -> list[torch.Tensor]:
    """Each rank's gradients computed alone, then summed (and averaged) over the ranks."""
    per_rank = []
    for rank in range(size):
        alone = copy.deepcopy(model)
        loss(alone, rank_data(rank, step)).backward()
        per_rank.append(gradients(alone))
    totals = [sum(grads[1:], grads[0].clone()) for grads in zip(*per_rank, strict=True)]
    return [t / size for t in totals] if op == "average" else totals


@pytest.mark.parametrize("op", ["average", "sum"])
def test_synchronize_leaves_every_rank_the_exact_result_over_the_four_ranks(
    monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    job = ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)
    model = integer_model(3, 4, 2)
    expected = [reference_gradients(model, job.size, step, op) for step in range(STEPS)]

    def rank_main(hvd: RankHorovod) -> list[tuple[list[torch.Tensor], list[str]]]:
        """Per step: the gradients after ``synchronize``, and the reduce-scatters submitted during backward."""
        mine = copy.deepcopy(model)
        sync = HierarchicalGradientSync(
            build_node_groups(discover_topology()),
            NoCompression(),
            op,
            CommCounters(),
            bucket_bytes=1,  # one bucket per tensor
            flat_below_bytes=0,  # every bucket takes the two-level legs
            tune_route=False,
        )
        optimizer = sync.wrap(torch.optim.SGD(mine.parameters(), lr=0.0), list(mine.named_parameters()))
        steps = []
        for step in range(STEPS):
            optimizer.zero_grad()
            sync.before_backward(optimizer)
            before = len(hvd.calls)
            loss(mine, rank_data(hvd.rank(), step)).backward()
            in_backward = sorted(name for _, name in hvd.calls[before:] if name.endswith(".rs"))
            sync.synchronize(optimizer)
            steps.append((gradients(mine), in_backward))
        sync.teardown([optimizer])
        return steps

    every_bucket = sorted(f"grad.opt0.{index}.rs" for index in range(len(list(model.parameters()))))
    for steps in job.run(rank_main):
        for step, (synchronized, in_backward) in enumerate(steps):
            assert all(torch.equal(got, want) for got, want in zip(synchronized, expected[step], strict=True)), step
            assert in_backward == every_bucket  # backward's hooks started every bucket's sum, at every step


def test_an_op_other_than_average_or_sum_is_refused() -> None:
    groups = build_node_groups(Topology(rank=0, nodes=((0, 1), (2, 3))))
    with pytest.raises(ValueError, match="op='max' is not supported with sync='hierarchical'"):
        HierarchicalGradientSync(groups, NoCompression(), "max", CommCounters())
