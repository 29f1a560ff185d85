"""Which flat syncs sum buckets and which keep Horovod's per-gradient hooks (real jobs: the strategy tests)."""

from __future__ import annotations

import pytest
from torch import nn

from hvd_plugins.core.sync.bucketed import has_sparse_gradients, uses_buckets


@pytest.mark.parametrize(
    ("op", "predivide", "sparse_as_dense", "expected"),
    [
        ("average", 1.0, False, True),
        ("sum", 1.0, False, True),
        ("adasum", 1.0, False, False),  # combines updates inside Horovod's hooks
        ("average", 2.0, False, False),  # Horovod's prescale and postscale
        ("average", 1.0, True, False),  # Horovod's own densifying of sparse gradients
    ],
)
def test_buckets_carry_average_and_sum_without_hook_only_options(
    op: str, predivide: float, sparse_as_dense: bool, expected: bool
) -> None:
    assert uses_buckets(op, predivide, sparse_as_dense) is expected


def test_a_sparse_embedding_anywhere_in_the_model_keeps_horovods_hooks() -> None:
    dense = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    assert not has_sparse_gradients(dense)
    assert has_sparse_gradients(nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Embedding(10, 4, sparse=True))))
    assert has_sparse_gradients(nn.EmbeddingBag(10, 4, sparse=True))
