"""Single-process tests of the pieces that need no running Horovod job."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import hvd_plugins
from hvd_plugins import AtomicCheckpointIO, HorovodStrategy
from hvd_plugins.core.comm.buckets import bucket_tensors, flatten, unflatten_into
from hvd_plugins.core.comm.compression import CountingCompressor, FP16Compression, NoCompression, compressor_by_name
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.parameters import indexed_optimizer_parameters, optimizer_parameters
from hvd_plugins.core.comm.partners import PartnerGroup, add_in_order
from hvd_plugins.core.comm.route_tuning import FLAT, TWO_LEVEL, RouteTuner
from hvd_plugins.core.comm.topology import NodeGroups, Topology, build_node_groups
from hvd_plugins.core.comm.wire import for_wire, from_wire, nbytes, reduce_op_name, wire_dtype
from hvd_plugins.core.cpu_threads import choose_cpu_threads
from hvd_plugins.core.daso.config import DasoConfig


def test_fp16_compression_round_trip_halves_bytes() -> None:
    tensor = torch.linspace(-3, 3, 101, dtype=torch.float32)
    wire, ctx = FP16Compression().compress(tensor)
    assert wire.dtype == torch.float16 and wire.element_size() * wire.numel() == 2 * 101
    back = FP16Compression().decompress(wire, ctx)
    assert back.dtype == torch.float32
    assert torch.allclose(back, tensor, atol=2e-3)


def test_fp16_compression_leaves_integers_alone() -> None:
    tensor = torch.arange(10)
    wire, ctx = FP16Compression().compress(tensor)
    assert wire is tensor and FP16Compression().decompress(wire, ctx) is tensor


def test_compressor_by_name_rejects_unknown_names() -> None:
    assert isinstance(compressor_by_name("none"), NoCompression)
    with pytest.raises(ValueError, match=r"compression='bf16'.*\['fp16', 'none'\]"):
        compressor_by_name("bf16")


def test_counting_compressor_records_wire_bytes() -> None:
    counters = CommCounters()
    codec = CountingCompressor(FP16Compression(), counters, Scope.CROSS_NODE)
    codec.compress(torch.zeros(1000))
    codec.compress(torch.zeros(10))
    assert counters.cross_node_bytes == 2 * 1010 and counters.cross_node_calls == 2
    assert counters.node_local_bytes == 0


def test_counters_window_difference() -> None:
    counters = CommCounters()
    counters.record(Scope.NODE_LOCAL, 100)
    start = counters.snapshot()
    counters.record(Scope.NODE_LOCAL, 50)
    counters.record(Scope.CROSS_NODE, 7, calls=3)
    window = counters.since(start)
    assert (window.node_local_bytes, window.node_local_calls) == (50, 1)
    assert (window.cross_node_bytes, window.cross_node_calls) == (7, 3)
    counters.reset()
    assert counters.as_dict()["node_local_bytes"] == 0


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


def test_topology_rejects_unequal_nodes_with_the_sizes() -> None:
    topology = Topology.from_pairs(rank=0, pairs=[(0, 0), (0, 1), (1, 0)])
    with pytest.raises(ValueError, match=r"same number of workers on every node.*\{0: 2, 1: 1\}"):
        topology.require_equal_nodes("sync='hierarchical'")


def test_buckets_split_by_dtype_and_size_and_round_trip() -> None:
    tensors = [torch.ones(10), torch.ones(300), torch.ones(5, dtype=torch.float64), torch.ones(20)]
    buckets = bucket_tensors(tensors, bucket_bytes=400 * 4)
    assert sorted(len(b) for b in buckets) == [1, 3]
    assert all(len({t.dtype for t in bucket}) == 1 for bucket in buckets)
    small = bucket_tensors(tensors, bucket_bytes=100)
    assert len(small) == 4
    flat = flatten([tensors[0], tensors[3]]) * 2
    unflatten_into(flat, [tensors[0], tensors[3]])
    assert float(tensors[0].sum()) == 20 and float(tensors[3].sum()) == 40


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compression": "int8"}, r"compression='int8' is not supported; choose one of \['fp16', 'none'\]"),
        ({"op": "mean"}, r"op='mean' is not supported; choose one of \['average', 'sum', 'adasum'\]"),
        ({"sync": "ring"}, r"sync='ring' is not supported; choose one of \['allreduce', 'hierarchical', 'daso'\]"),
        ({"gradient_predivide_factor": 0}, r"gradient_predivide_factor=0 must be a positive number"),
        ({"gradient_predivide_factor": 2.0, "op": "sum"}, r"works only with op='average', not op='sum'"),
        ({"op": "adasum", "sync": "daso"}, r"op='adasum' works only with sync='allreduce'"),
        ({"op": "sum", "sync": "daso"}, r"op='sum' does not work with sync='daso'.*use op='average'"),
        ({"daso": {"warmup_epochs": 1}}, r"DASO settings need sync='daso'"),
        ({"hierarchical_impl": "nccl"}, r"hierarchical_impl='nccl' is not supported"),
        ({"bucket_mb": -1}, r"bucket_mb=-1 must be a positive number"),
        ({"sync": "hierarchical", "flat_below_mb": -1}, r"flat_below_mb=-1 must be 'auto' or a number of"),
        ({"flat_below_mb": 4.0}, r"flat_below_mb=4.0 works only with sync='hierarchical', not sync='allreduce'"),
        ({"cpu_threads": 0}, r"cpu_threads=0 must be 'auto', None or a whole number of threads >= 1"),
        ({"cpu_threads": "all"}, r"cpu_threads='all' must be 'auto', None or a whole number"),
    ],
)
def test_strategy_rejects_bad_arguments_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HorovodStrategy(**kwargs)


def test_adasum_is_refused_at_construction_by_a_build_without_mpi() -> None:
    import horovod.torch as hvd

    if hvd.mpi_built():
        assert HorovodStrategy(op="adasum").config.op == "adasum"  # the controller is checked when the job starts
    else:
        with pytest.raises(ValueError, match=r"op='adasum' needs Horovod's MPI controller, but this Horovod build"):
            HorovodStrategy(op="adasum")


def test_daso_settings_accept_dicts_and_name_unknown_keys() -> None:
    strategy = HorovodStrategy(sync="daso", daso={"warmup_epochs": 1, "max_global_skips": 4})
    assert strategy.config.daso == DasoConfig(warmup_epochs=1, max_global_skips=4)
    with pytest.raises(ValueError, match=r"unknown DASO setting\(s\) \['warmup'\]"):
        HorovodStrategy(sync="daso", daso={"warmup": 1})


def test_import_registers_strategy_names() -> None:
    assert hvd_plugins.HorovodStrategy is HorovodStrategy
    for name in ("horovod", "horovod_fp16", "horovod_hierarchical", "horovod_daso"):
        assert name in StrategyRegistry
    assert StrategyRegistry["horovod_fp16"]["init_params"] == {"compression": "fp16"}


def test_atomic_checkpoint_leaves_old_file_when_saving_fails(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, target)

    class Unpicklable:
        def __reduce__(self) -> tuple:
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        io.save_checkpoint({"step": 2, "bad": Unpicklable()}, target)
    assert torch.load(target, weights_only=False) == {"step": 1}
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the temporary file was removed


def test_atomic_checkpoint_gets_the_mode_a_plain_save_gets(tmp_path: Path) -> None:
    """0666 less the umask, as ``torch.save`` to a path gives, not the 0600 of a private temporary file."""
    previous = os.umask(0o022)
    try:
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "atomic.ckpt")
        torch.save({"step": 1}, tmp_path / "plain.ckpt")
        os.umask(0o007)
        AtomicCheckpointIO().save_checkpoint({"step": 2}, tmp_path / "group.ckpt")
    finally:
        os.umask(previous)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("atomic.ckpt", "plain.ckpt", "group.ckpt")}
    assert modes == {"atomic.ckpt": 0o644, "plain.ckpt": 0o644, "group.ckpt": 0o660}
    assert sorted(os.listdir(tmp_path)) == ["atomic.ckpt", "group.ckpt", "plain.ckpt"]


@pytest.mark.parametrize(
    ("dtype", "op", "wire", "back"),
    [
        (torch.bfloat16, "sum", torch.float32, torch.bfloat16),
        (torch.bfloat16, "gather", torch.float32, torch.bfloat16),
        (torch.bool, "sum", torch.int64, torch.bool),
        (torch.bool, "max", torch.int64, torch.bool),
        (torch.bool, "gather", torch.uint8, torch.bool),
        (torch.bool, "average", torch.float64, torch.float64),
        (torch.int32, "average", torch.float64, torch.float64),  # an average of integers stays a float
        (torch.int32, "sum", torch.int32, torch.int32),
        (torch.float16, "average", torch.float16, torch.float16),
        (torch.float64, "gather", torch.float64, torch.float64),
    ],
)
def test_wire_dtype_and_the_way_back(dtype: torch.dtype, op: str, wire: torch.dtype, back: torch.dtype) -> None:
    tensor = torch.ones(3, dtype=dtype)
    assert wire_dtype(dtype, op) == wire and for_wire(tensor, op).dtype == wire
    assert from_wire(for_wire(tensor, op), dtype, op).dtype == back


def test_reduce_op_names_accept_aliases_and_enums_only() -> None:
    assert [reduce_op_name(op) for op in (None, "mean", "AVG", "sum", "max", "min")] == [
        "average", "average", "average", "sum", "max", "min"]  # fmt: skip
    assert reduce_op_name(torch.distributed.ReduceOp.SUM) == "sum"
    with pytest.raises(ValueError, match=r"reduce_op='product' is not supported; choose one of \['average', 'avg'"):
        reduce_op_name("product")
    assert nbytes(torch.zeros(3, 4, dtype=torch.float16)) == 24


def test_optimizer_parameters_walk_groups_in_order() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (1, 2, 3))
    b.requires_grad_(False)
    optimizer = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
    assert optimizer_parameters(optimizer) == [a, b, c]
    assert optimizer_parameters(optimizer, trainable_only=True) == [a, c]
    assert [(g, i) for g, i, _ in indexed_optimizer_parameters(optimizer)] == [(0, 0), (0, 1), (1, 0)]


def _run_tuner(
    two_level_s: list[float], flat_s: list[float], untimed: tuple[int, ...] = ()
) -> tuple[RouteTuner, list[str], list[torch.Tensor]]:
    """Feeds the tuner the next time of the route it asks for (9 s on the warm-up steps, None on ``untimed``)."""
    agreed: list[torch.Tensor] = []
    tuner = RouteTuner(lambda t: agreed.append(t) or t * 1.0, trials_per_route=3)
    times = {TWO_LEVEL: iter(two_level_s), FLAT: iter(flat_s)}
    routes = []
    for step in range(12):
        routes.append(tuner.route)
        warm_up = step < 2 and step not in untimed
        tuner.record(None if step in untimed else 9.0 if warm_up else next(times[routes[-1]], 0.0))
    return tuner, routes, agreed


def test_route_tuner_warms_each_route_up_then_alternates_and_keeps_the_faster() -> None:
    tuner, routes, agreed = _run_tuner(two_level_s=[0.3, 0.1, 0.3], flat_s=[0.2, 0.2, 0.2])
    assert routes[:8] == [TWO_LEVEL, FLAT, TWO_LEVEL, FLAT, TWO_LEVEL, FLAT, TWO_LEVEL, FLAT]  # 2 untimed first
    assert routes[8:] == [FLAT] * 4 and tuner.choice == FLAT  # medians 0.3 against 0.2
    assert len(agreed) == 2  # after 2 trials each (not clear: 0.1 < 0.2 < 0.3), then after the last
    assert tuner.seconds == {TWO_LEVEL: [0.3, 0.1, 0.3], FLAT: [0.2] * 3}  # the warm-up 9 s steps are not counted
    assert tuner.measured() == "300.0 ms two_level vs 200.0 ms flat (median of 3 steps each, mean over workers)"
    tuner, routes, _ = _run_tuner(two_level_s=[0.1, 0.1, 0.1], flat_s=[0.1, 0.1, 0.1])
    assert tuner.choice == FLAT  # ties keep the flat route


def test_route_tuner_stops_early_when_every_step_of_one_route_beats_the_other() -> None:
    tuner, routes, agreed = _run_tuner(two_level_s=[0.1, 0.12], flat_s=[0.3, 0.25])
    assert routes[6:] == [TWO_LEVEL] * 6 and tuner.choice == TWO_LEVEL
    assert len(agreed) == 1 and tuner.seconds == {TWO_LEVEL: [0.1, 0.12], FLAT: [0.3, 0.25]}


def test_route_tuner_stops_early_when_one_median_is_far_above_the_other() -> None:
    tuner, routes, agreed = _run_tuner(two_level_s=[0.3, 0.05], flat_s=[0.1, 0.1])  # medians 0.175 and 0.1
    assert routes[6:] == [FLAT] * 6 and len(agreed) == 1
    tuner, routes, agreed = _run_tuner(two_level_s=[0.14, 0.14, 0.14], flat_s=[0.1, 0.15, 0.1])  # 1.12x: not clear
    assert len(agreed) == 2 and tuner.choice == FLAT and len(tuner.seconds[FLAT]) == 3


def test_route_tuner_runs_an_untimed_step_again_on_the_same_route() -> None:
    tuner, routes, _ = _run_tuner(two_level_s=[0.3, 0.3], flat_s=[0.1, 0.1], untimed=(2, 3))
    assert routes[:6] == [TWO_LEVEL, FLAT, TWO_LEVEL, TWO_LEVEL, TWO_LEVEL, FLAT]
    assert tuner.choice == FLAT and tuner.seconds == {TWO_LEVEL: [0.3, 0.3], FLAT: [0.1, 0.1]}


def test_route_tuner_refuses_zero_trials() -> None:
    with pytest.raises(ValueError, match="trials_per_route=0 must be >= 1"):
        RouteTuner(lambda t: t, trials_per_route=0)


def test_route_tuner_state_round_trips_so_a_resumed_run_keeps_the_route() -> None:
    tuner, _, _ = _run_tuner(two_level_s=[0.1, 0.1], flat_s=[0.3, 0.3])
    restored = RouteTuner.restored(tuner.state_dict())
    assert restored.choice == TWO_LEVEL and restored.route == TWO_LEVEL
    assert restored.agreed_seconds == tuner.agreed_seconds
    restored.record(5.0)  # decided: nothing is timed or agreed again
    with pytest.raises(ValueError, match="not a route tuner's state"):
        RouteTuner.restored({"routes": ["two_level", "flat"], "choice": "ring", "agreed_seconds": {}})


def test_cpu_threads_share_the_host_unless_the_user_chose() -> None:
    assert choose_cpu_threads("auto", workers_on_host=4, cpus=16, environ={}) == 4
    assert choose_cpu_threads("auto", workers_on_host=4, cpus=2, environ={}) == 1  # never below one
    assert choose_cpu_threads("auto", workers_on_host=1, cpus=16, environ={}) is None  # alone: torch's default
    assert choose_cpu_threads("auto", workers_on_host=4, cpus=16, environ={"OMP_NUM_THREADS": "8"}) is None
    assert choose_cpu_threads(3, workers_on_host=4, cpus=16, environ={"OMP_NUM_THREADS": "8"}) == 3
    assert choose_cpu_threads(None, workers_on_host=4, cpus=16, environ={}) is None
    assert "cpu_threads" not in HorovodStrategy(cpu_threads=2).config.fingerprint()  # hosts may differ


def test_daso_sharding_takes_only_cross_node_pairs_whose_sum_ends_in_the_wire_type() -> None:
    """The merge gathers the cross-node sum in its wire type: a relaying pair's sum is in it, an exchanging
    pair's (float32 of two float16 pieces) is not, and gathering that would round it."""
    from hvd_plugins.core.daso.parameter_sync import CrossNodeSharding

    groups = build_node_groups(Topology(rank=0, nodes=((0, 1), (2, 3))))
    assert groups.cross is not None and groups.cross.relays
    CrossNodeSharding(groups, CommCounters(), chunk_numel=1024)  # the groups the strategy builds
    exchanging = NodeGroups(groups.topology, groups.local, PartnerGroup((0, 2), 0, 4), groups.world)
    with pytest.raises(ValueError, match=r"cross-node pair \(0, 2\) must relay"):
        CrossNodeSharding(exchanging, CommCounters(), chunk_numel=1024)
