"""The two-level sum on a job of two nodes of two workers, every rank a thread of this process
(``ThreadedJob``): exact results, bytes per leg, the flat route for small buffers, sums started in any order.

Inputs are float64 integers (or small integers in float32, exact in float16), so every order of
addition gives the same bits and a result can be compared with the sum for equality.
"""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.comm.compression import FP16Compression
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.comm.in_flight import finish_all
from hvd_plugins.core.comm.topology import Topology, build_node_groups, discover_topology
from hvd_plugins.core.comm.two_level import hierarchical_allreduce_, start_bucket_sum, write_total
from unit.threaded_horovod import RankHorovod, ThreadedJob


def integers(rank: int, numel: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s buffer: small integers, different on every rank and for every seed."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-50, 51, (numel,), generator=generator).to(dtype)


def total(size: int, numel: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return sum((integers(rank, numel, dtype, seed) for rank in range(size)), torch.zeros(numel, dtype=dtype))


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> ThreadedJob:
    return ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)


@pytest.mark.parametrize("round_robin", [False, True], ids=["ranks_by_node", "ranks_round_robin"])
@pytest.mark.parametrize("average", [True, False], ids=["average", "sum"])
def test_hierarchical_allreduce_gives_the_exact_sum_or_average_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, round_robin: bool, average: bool
) -> None:
    job = ThreadedJob(nodes=2, workers_per_node=2, round_robin=round_robin).install(monkeypatch)
    sizes = [1, 7, 1000]  # odd sizes are padded to the two local workers' shards

    def rank_main(hvd: RankHorovod) -> list[torch.Tensor]:
        groups = build_node_groups(discover_topology())
        buffers = [integers(hvd.rank(), n, seed=index) for index, n in enumerate(sizes)]
        hierarchical_allreduce_(buffers, groups, average=average)
        return buffers

    expected = [total(4, n, seed=index) / (4 if average else 1) for index, n in enumerate(sizes)]
    for buffers in job.run(rank_main):
        assert all(torch.equal(got, want) for got, want in zip(buffers, expected, strict=True))
    legs = {name.rsplit(".", 1)[-1] for hvd in job.ranks for kind, name in hvd.calls if kind == "alltoall"}
    assert legs == {"rs", "r1", "r2", "ag"}  # reduce-scatter, the cross-node relay's two rounds, allgather


@pytest.mark.parametrize("compress_node_local", [False, True])
def test_fp16_compression_is_counted_per_leg(job: ThreadedJob, compress_node_local: bool) -> None:
    """Per buffer of n padded elements: the reduce-scatter hands on n, the allgather n/2 (node-local), and n/2
    cross nodes, in float16 where compressed and float32 elsewhere."""
    sizes = [5, 8]

    def rank_main(hvd: RankHorovod) -> tuple[list[torch.Tensor], CommCounters]:
        counters = CommCounters()
        buffers = [integers(hvd.rank(), n, torch.float32, seed=index) for index, n in enumerate(sizes)]
        groups = build_node_groups(discover_topology())
        compression = FP16Compression()
        hierarchical_allreduce_(
            buffers, groups, compression=compression, compress_node_local=compress_node_local, counters=counters
        )
        return buffers, counters

    padded = [6, 8]
    local_bytes = 2 if compress_node_local else 4
    for rank, (buffers, counters) in enumerate(job.run(rank_main)):
        expected = [total(4, n, torch.float32, seed=index) / 4 for index, n in enumerate(sizes)]
        assert all(torch.equal(got, want) for got, want in zip(buffers, expected, strict=True)), rank
        assert counters.cross_node_bytes == 2 * sum(n // 2 for n in padded)
        assert counters.node_local_bytes == local_bytes * sum(n + n // 2 for n in padded)
        assert (counters.cross_node_calls, counters.node_local_calls) == (len(sizes), 2 * len(sizes))


def test_a_buffer_below_flat_below_bytes_takes_one_allreduce_over_every_worker(job: ThreadedJob) -> None:
    small, large = 10, 64  # float64: 80 bytes under the threshold, 512 over it

    def rank_main(hvd: RankHorovod) -> tuple[list[torch.Tensor], CommCounters]:
        counters = CommCounters()
        buffers = [integers(hvd.rank(), small, seed=0), integers(hvd.rank(), large, seed=1)]
        hierarchical_allreduce_(
            buffers, build_node_groups(discover_topology()), counters=counters, name="mixed", flat_below_bytes=100
        )
        return buffers, counters

    for buffers, counters in job.run(rank_main):
        assert torch.equal(buffers[0], total(4, small, seed=0) / 4)
        assert torch.equal(buffers[1], total(4, large, seed=1) / 4)
        assert counters.cross_node_bytes == 8 * (small + large // 2)  # the whole small buffer crosses, once
        assert counters.node_local_bytes == 8 * (large + large // 2)
    for hvd in job.ranks:
        small_sum = [(kind, name) for kind, name in hvd.calls if name.startswith("mixed.0")]
        assert small_sum == [("allreduce", "mixed.0.flat")]
        assert all(name.startswith("mixed.1.") for kind, name in hvd.calls if kind == "alltoall")


def test_sums_started_in_any_order_finish_together(job: ThreadedJob) -> None:
    """Each rank starts its buckets' sums in its own order (as backward completes them) and finishes them in one."""
    sizes_and_types = [(9, torch.float64), (4, torch.float32), (31, torch.float64)]

    def rank_main(hvd: RankHorovod) -> list[torch.Tensor]:
        groups = build_node_groups(discover_topology())
        buffers = [integers(hvd.rank(), n, dtype, seed=index) for index, (n, dtype) in enumerate(sizes_and_types)]
        order = range(len(buffers)) if hvd.rank() % 2 == 0 else reversed(range(len(buffers)))
        counters = CommCounters()
        started = {i: start_bucket_sum(buffers[i], groups, counters=counters, name=f"b{i}") for i in order}
        pending = [started[index] for index in range(len(buffers))]
        assert all(sum_ is not None for sum_ in pending)
        for buffer, result in zip(buffers, finish_all([sum_ for sum_ in pending if sum_ is not None]), strict=True):
            write_total(buffer, result, divide_by=None)
        return buffers

    for buffers in job.run(rank_main):
        for index, (buffer, (n, dtype)) in enumerate(zip(buffers, sizes_and_types, strict=True)):
            assert buffer.dtype == dtype and torch.equal(buffer, total(4, n, dtype, seed=index))


def test_one_node_sums_in_one_allreduce_and_one_worker_needs_no_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    job = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)

    def rank_main(hvd: RankHorovod) -> torch.Tensor:
        buffer = integers(hvd.rank(), 5)
        hierarchical_allreduce_([buffer], build_node_groups(discover_topology()), average=False, name="one")
        return buffer

    for buffer in job.run(rank_main):
        assert torch.equal(buffer, total(2, 5))
    assert [call for call in job.ranks[0].calls if call[1].startswith("one")] == [("allreduce", "one.0.ar")]
    alone = build_node_groups(Topology(rank=0, nodes=((0,),)))
    assert start_bucket_sum(torch.ones(3), alone, counters=CommCounters(), name="alone") is None
