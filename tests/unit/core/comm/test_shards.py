"""The one shard layout: equal shards, the last one zero-padded, whose is which, and layouts that cannot be."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.comm.shards import ShardLayout


def test_an_uneven_vector_is_padded_to_whole_shards_and_each_worker_owns_its_slice() -> None:
    flat = torch.arange(1.0, 11.0)  # 10 elements in 4 shards of 3: two zeros of padding at the end
    layouts = [ShardLayout(numel=10, parts=4, index=index) for index in range(4)]
    assert [(layout.shard_numel, layout.padded_numel, layout.start) for layout in layouts] == [
        (3, 12, 0),
        (3, 12, 3),
        (3, 12, 6),
        (3, 12, 9),
    ]
    assert layouts[0].padded(flat).tolist() == [*range(1, 11), 0, 0]
    assert layouts[1].shard_of(flat).tolist() == [4.0, 5.0, 6.0]
    assert layouts[3].shard_of(flat).tolist() == [10.0, 0.0, 0.0]  # the last shard carries the padding
    assert torch.equal(torch.cat([layout.shard_of(flat) for layout in layouts]), layouts[0].padded(flat))


def test_an_even_vector_is_not_copied_to_pad_but_a_shard_is_always_a_copy() -> None:
    flat = torch.arange(8, dtype=torch.float16)
    layout = ShardLayout(numel=8, parts=2, index=1)
    assert layout.padded(flat) is flat
    shard = layout.shard_of(flat)
    shard.zero_()
    assert flat.tolist() == list(range(8))  # writing the shard leaves the vector alone
    padded = ShardLayout(numel=7, parts=2).padded(flat[:7])
    assert padded.dtype == torch.float16 and padded.tolist() == [*range(7), 0]


def test_empty_vectors_and_single_shards() -> None:
    empty = ShardLayout(numel=0, parts=3, index=2)
    assert (empty.shard_numel, empty.padded_numel, empty.start) == (0, 0, 0)
    assert empty.shard_of(torch.zeros(0)).numel() == 0 and empty.padded(torch.zeros(0)).numel() == 0
    whole = ShardLayout(numel=5, parts=1)
    assert torch.equal(whole.shard_of(torch.arange(5)), torch.arange(5))


@pytest.mark.parametrize(
    ("numel", "parts", "index"),
    [(10, 0, 0), (10, 4, 4), (10, 4, -1), (-1, 2, 0)],
    ids=["no_parts", "index_past_the_last", "negative_index", "negative_numel"],
)
def test_a_layout_that_cannot_be_is_refused_naming_its_fields(numel: int, parts: int, index: int) -> None:
    with pytest.raises(ValueError, match=f"not a shard layout: numel={numel}, parts={parts}, index={index}"):
        ShardLayout(numel=numel, parts=parts, index=index)
