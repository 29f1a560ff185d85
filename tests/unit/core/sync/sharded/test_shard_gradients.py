"""Gradient shards: torch's own norms and clipping over every worker's parts, as one process over the whole."""

from __future__ import annotations

import math

import pytest
import torch

from hvd_plugins.core.sync.sharded.shard_gradients import PartialNorm, ShardedNorms, ShardGradient
from unit.threaded_horovod import RankHorovod, ThreadedJob

WHOLE = [torch.tensor([3.0, -4.0, 1.0, 2.0, 0.5]), torch.tensor([[1.0, -2.0], [2.0, 6.0]])]
"""Two parameters' whole averaged gradients; each worker of two holds a part of each (the parts below)."""


def parts(rank: int) -> list[torch.Tensor]:
    """Worker ``rank``'s part of each gradient, flattened (a flat slice may cut a row, or hold none of one)."""
    first, second = WHOLE[0], WHOLE[1].reshape(-1)
    return [first[:3].clone(), second[:0].clone()] if rank == 0 else [first[3:].clone(), second.clone()]


def shard_parameters(rank: int, norms: ShardedNorms) -> list[torch.nn.Parameter]:
    parameters = []
    for part in parts(rank):
        parameter = torch.nn.Parameter(torch.zeros_like(part))
        parameter.grad = ShardGradient.of(part, norms)
        parameters.append(parameter)
    return parameters


def whole_parameters() -> list[torch.nn.Parameter]:
    parameters = []
    for whole in WHOLE:
        parameter = torch.nn.Parameter(torch.zeros_like(whole))
        parameter.grad = whole.clone()
        parameters.append(parameter)
    return parameters


@pytest.mark.parametrize("order", [2.0, 1.0, math.inf])
def test_torch_clipping_over_the_shards_is_one_process_clipping_the_whole(
    monkeypatch: pytest.MonkeyPatch, order: float
) -> None:
    job = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)
    expected_parameters = whole_parameters()
    expected = torch.nn.utils.clip_grad_norm_(expected_parameters, 1.5, order)

    def clip(hvd: RankHorovod) -> tuple[float, list[torch.Tensor]]:
        parameters = shard_parameters(hvd.rank(), ShardedNorms())
        total = torch.nn.utils.clip_grad_norm_(parameters, 1.5, order)
        assert type(total) is torch.Tensor  # a number, not a share
        return float(total), [p.grad.clone() for p in parameters]

    clipped_whole = [p.grad.reshape(-1) for p in expected_parameters]
    results = job.run(clip)
    for rank, (total, gradients) in enumerate(results):
        assert total == pytest.approx(float(expected), rel=1e-6)
        for gradient, whole, part in zip(gradients, clipped_whole, parts(rank), strict=True):
            start = 0 if rank == 0 else whole.numel() - part.numel()
            assert torch.allclose(gradient, whole[start : start + part.numel()])


def test_whole_gradients_beside_shards_count_once_and_foreach_takes_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter every worker holds whole (a plain ``.grad``) counts once, not once per worker."""
    job = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)
    extra = torch.tensor([2.0, 2.0])
    expected = math.sqrt(sum(float(w.pow(2).sum()) for w in WHOLE) + 8.0)

    def total(hvd: RankHorovod) -> tuple[float, float]:
        parameters = shard_parameters(hvd.rank(), ShardedNorms())
        plain = torch.nn.Parameter(torch.zeros(2))
        plain.grad = extra.clone()
        clipped = torch.nn.utils.clip_grad_norm_([*parameters, plain], 1e9, foreach=True)
        return float(clipped), float(parameters[0].grad.norm() ** 2)  # a share used as a number: made whole

    for clipped, first in job.run(total):
        assert clipped == pytest.approx(expected, rel=1e-6)
        assert first == pytest.approx(float(WHOLE[0].pow(2).sum()), rel=1e-6)


def test_a_norm_of_one_shard_is_a_share_until_used(monkeypatch: pytest.MonkeyPatch) -> None:
    job = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)

    def norm(hvd: RankHorovod) -> tuple[bool, float]:
        gradient = shard_parameters(hvd.rank(), ShardedNorms())[0].grad
        share = torch.linalg.vector_norm(gradient)
        return isinstance(share, PartialNorm), share.item()

    for is_share, value in job.run(norm):
        assert is_share and value == pytest.approx(float(torch.linalg.vector_norm(WHOLE[0])), rel=1e-6)


def test_gradients_the_shards_do_not_show_make_torch_clipping_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    job = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)

    def clip(hvd: RankHorovod) -> str:
        parameters = shard_parameters(hvd.rank(), ShardedNorms(hidden=["cls_token"]))
        with pytest.raises(ValueError, match="cls_token") as refused:
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        return str(refused.value)

    for message in job.run(clip):
        assert "fabric.clip_gradients" in message and "gradient_clip_val" in message


def test_a_matrix_norm_of_a_shard_is_refused_naming_the_way() -> None:
    gradient = ShardGradient.of(torch.ones(4), ShardedNorms())
    with pytest.raises(ValueError, match="fabric.clip_gradients"):
        torch.norm(gradient, p="nuc")
