"""Partner groups: who sends to whom, and the order pieces are added in."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.comm.partners import PartnerGroup, WorldAllgather, add_in_order, start_slices_gather
from unit.threaded_horovod import RankHorovod, ThreadedJob


def test_partner_group_sends_only_to_partners_and_reads_pieces_in_group_order() -> None:
    group = PartnerGroup(ranks=(3, 1, 2), rank=1, world=4)  # group order: rank 3, then 1, then 2
    assert group.others == (2, 3)
    assert group.splits(5).tolist() == [0, 0, 5, 5]  # nothing to rank 0, outside the group, nor to itself
    # alltoall wants the other members' pieces in ascending rank: rank 2's (group index 2), then rank 3's
    pieces = [torch.full((2,), 30.0), torch.full((2,), 10.0), torch.full((2,), 20.0)]
    assert group.ascending(pieces).tolist() == [20.0, 20.0, 30.0, 30.0]
    received = torch.tensor([2.0, 2.0, 3.0, 3.0])  # from rank 2, then rank 3
    own = torch.full((2,), 1.0)
    assert [piece.tolist() for piece in group.pieces(received, own)] == [[3.0, 3.0], [1.0, 1.0], [2.0, 2.0]]
    with pytest.raises(ValueError, match="rank 0 is not in the partner group"):
        PartnerGroup(ranks=(3, 1), rank=0, world=4)


def test_add_in_order_adds_half_types_in_float32() -> None:
    pieces = [torch.tensor([60000.0], dtype=torch.float16)] * 3  # the float16 sum would overflow
    total = add_in_order(pieces)
    assert total.dtype == torch.float32 and total.item() == 180000.0
    alone = torch.tensor([1.0])
    assert add_in_order([alone]).item() == 1.0 and add_in_order([alone]) is not alone


@pytest.mark.parametrize("group_ranks", [(0, 1, 2, 3), (1, 3)], ids=["every_worker", "partners"])
def test_a_slices_gather_gives_every_members_shard_in_group_order(
    monkeypatch: pytest.MonkeyPatch, group_ranks: tuple[int, ...]
) -> None:
    """Over every worker Horovod's allgather carries it; within a smaller group a partner alltoall (the others
    take part with nothing to send)."""
    job = ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)

    def gather(hvd: RankHorovod) -> list[torch.Tensor] | None:
        rank = hvd.rank()
        if rank not in group_ranks:
            hvd.alltoall(torch.zeros(0), splits=torch.zeros(4, dtype=torch.int32), name="slices")
            return None
        group = PartnerGroup(group_ranks, rank, 4)
        pending = start_slices_gather(torch.full((3,), float(rank)), group, "slices")
        assert isinstance(pending, WorldAllgather) == (len(group_ranks) == 4)
        return pending.wait()

    for rank, pieces in enumerate(job.run(gather)):
        if rank in group_ranks:
            assert pieces is not None and [piece.tolist() for piece in pieces] == [[float(r)] * 3 for r in group_ranks]
