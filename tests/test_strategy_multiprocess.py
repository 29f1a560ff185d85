"""HorovodStrategy under real horovodrun jobs: Lightning features, numerics, topology."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _common import Check, case_argument, report_of
from conftest import two_node_reports
from hierarchical_checks import (
    check_buckets_start_in_backward,
    check_compress_node_local,
    check_route_tuning,
    check_startup,
    check_still_one_process_set,
    check_strategy_modes,
    check_topology,
    check_two_round_groups,
    fp32_fp16_wire,
    fp32_mixed,
    fp32_random,
    fp64_integers,
    fp64_random,
)
from hvd_launch import run_job, run_single
from strategy_batchnorm import check_average_buffers, check_sync_batchnorm, check_uneven_sync_batchnorm
from strategy_gradients import (
    check_accumulation,
    check_clipping,
    check_large_gradients_summed_in_place,
    check_manual_accumulation,
    check_reduce_ops,
    check_scale_lr,
)
from strategy_loops import (
    check_bf16_mixed,
    check_checkpoint_resume,
    check_collectives,
    check_float16_sum,
    check_idle_loop,
    check_loops,
    check_metrics,
    check_uneven_data,
    check_waiting_without_spinning,
)
from strategy_optimizers import (
    check_accumulation_change_mid_epoch,
    check_accumulation_schedule,
    check_learning_rate_schedules,
    check_manual_gan,
    check_manual_gan_ddp_style,
    check_unfrozen_layers_are_averaged,
)

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins",
    "hvd_plugins.pytorch",
    "hvd_plugins.pytorch.strategies.horovod",
    "hvd_plugins.pytorch.loop_events",
    "hvd_plugins.pytorch.utilities.callbacks",
    "hvd_plugins.pytorch.plugins.layer_sync",
    "hvd_plugins.fabric.lightning_internals",
    "hvd_plugins.fabric.plugins.environments.horovod",
    "hvd_plugins.fabric.plugins.io.atomic",
    "hvd_plugins.fabric.strategies.shared",
    "hvd_plugins.core.backend.optimizer",
    "hvd_plugins.core.backend.startup",
    "hvd_plugins.core.backend.waits",
    "hvd_plugins.core.comm.backward_buckets",
    "hvd_plugins.core.comm.buffers",
    "hvd_plugins.core.comm.collectives",
    "hvd_plugins.core.comm.gradients",
    "hvd_plugins.core.comm.naming",
    "hvd_plugins.core.comm.partners",
    "hvd_plugins.core.comm.reducer",
    "hvd_plugins.core.comm.topology",
    "hvd_plugins.core.comm.two_level",
    "hvd_plugins.core.comm.world_sum",
    "hvd_plugins.core.cpu_threads",
    "hvd_plugins.core.epoch_end",
    "hvd_plugins.core.metrics_sync",
    "hvd_plugins.core.sync.base",
    "hvd_plugins.core.sync.flat",
    "hvd_plugins.core.sync.hierarchical.mode",
    "hvd_plugins.core.sync.hierarchical.route_tuning",
    "hvd_plugins.core.sync_batchnorm",
    "hvd_plugins.core.training_state",
    "hvd_plugins.core.worker",
)

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def features(two_worker_checks: dict[int, dict]) -> dict[int, dict]:
    """The shared two-worker job's reports (see conftest.py)."""
    return two_worker_checks


def both(features: dict[int, dict], check: Check) -> list[Any]:
    return [report_of(features[rank], check) for rank in (0, 1)]


def test_accumulation_allreduces_once_per_k_and_matches_large_batch(features: dict[int, dict]) -> None:
    for result in both(features, check_accumulation):
        # 64 samples / 2 ranks / micro-batches of 4 = 8 micro-batches, k=2: 4 steps per epoch
        assert result["steps"] == 8
        assert result["allreduce_calls"] == result["steps"]  # one bucket: the whole model is under bucket_mb
        assert result["max_diff_vs_large_batch"] < 1e-10
        assert result["ranks_identical"]


def test_a_large_gradient_summed_where_it_lies_trains_as_the_large_batch(features: dict[int, dict]) -> None:
    for result in both(features, check_large_gradients_summed_in_place):
        assert result["steps"] == 4  # 32 samples / 2 ranks / micro-batches of 4, k=2: 2 steps per epoch
        assert result["allreduce_calls"] == 2 * result["steps"]  # the large weight alone, the rest in one bucket
        assert result["max_diff_vs_large_batch"] < 1e-10
        assert result["ranks_identical"]


def test_clipping_sees_averaged_gradients(features: dict[int, dict]) -> None:
    for result in both(features, check_clipping):
        assert result["clipping_mattered"] > 1e-3  # the test would notice clipping on the wrong gradients
        assert result["max_diff_vs_clipped_reference"] < 1e-10
        assert result["ranks_identical"]


def test_scale_lr_is_opt_in_and_scales_scheduler_base(features: dict[int, dict]) -> None:
    for result in both(features, check_scale_lr):
        assert result["default_lr"] == pytest.approx(0.01)
        assert result["lr"] == pytest.approx(0.01 * result["world"])
        assert result["base_lrs"] == pytest.approx([0.01 * result["world"]])


def test_reduce_all_gather_broadcast_barrier(features: dict[int, dict]) -> None:
    for rank, result in enumerate(both(features, check_collectives)):
        assert result["is_distributed"] is True
        assert result["sum"] == [3.0] and result["mean"] == [1.5] and result["max"] == [2.0]
        assert result["int_mean"] == [0.5]
        assert result["gathered"] == [[0.0, 0.0, 7.0], [1.0, 10.0, 7.0]]
        assert result["broadcast"] == {"from": 1}
        assert result["any_true"] is True and result["all_true"] is False
        assert result["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}


def test_float16_allreduce_adds_like_float32_rounded_once(features: dict[int, dict]) -> None:
    for result in both(features, check_float16_sum):
        assert result["exact"] == {"1": True, "7": True, "8": True, "9": True, "1003": True, "100001": True}


def test_a_rank_waiting_in_a_collective_leaves_the_cpu_to_the_others(features: dict[int, dict]) -> None:
    waiting = both(features, check_waiting_without_spinning)[1]  # rank 0 arrives a second late
    assert waiting["waited_seconds"] > 0.5, waiting
    # A spinning wait takes about all of it.
    assert waiting["thread_cpu_seconds"] < 0.2 * waiting["waited_seconds"], waiting


def test_an_idle_loop_sleeps_and_a_late_collective_wakes_it(features: dict[int, dict]) -> None:
    coordinator, waiter = both(features, check_idle_loop)  # rank 0 comes half a second late
    assert coordinator["idle_env"] == waiter["idle_env"] == "2000"
    assert coordinator["recorded"], coordinator
    # A second of nothing queued between two allreduces: a stock loop runs hundreds of rounds.
    assert coordinator["rounds_in_idle_seconds"] <= 6, coordinator
    # The late rank is answered at once, not at its next idle round (up to 2 s away)...
    assert coordinator["answered_seconds"] < 0.4, coordinator
    # ... and the rank that waited for it finishes together with it.
    assert waiter["answered_seconds"] > 0.4, waiter
    assert abs(waiter["finished_at_seconds"] - coordinator["finished_at_seconds"]) < 0.4, (coordinator, waiter)


def test_two_workers_on_a_host_share_its_cores_unless_omp_num_threads_says_otherwise(
    features: dict[int, dict],
) -> None:
    for result in both(features, check_collectives):
        chosen = result["omp_num_threads"]
        expected = int(chosen) if chosen else max(1, result["usable_cpus"] // 2)
        assert result["torch_threads"] == expected, result


def test_torchmetrics_sync_equals_metric_on_full_data(features: dict[int, dict]) -> None:
    results = both(features, check_metrics)
    assert any(abs(r["local"] - r["full_data"]) > 1e-3 for r in results)  # syncing matters on this data
    for result in results:
        assert result["logged"] == pytest.approx(result["full_data"], abs=1e-6)  # logged as float32


def test_validation_test_predict_loops(features: dict[int, dict]) -> None:
    for result in both(features, check_loops):
        # mean of per-rank means over equal halves = the full-data loss
        assert result["val_loss"] == pytest.approx(result["full_data_loss"], rel=1e-9)
        assert result["test_loss"] == pytest.approx(result["full_data_loss"], rel=1e-9)
        assert result["predicted_rows"] == 20  # each rank predicts its half of 40 rows
        assert result["ranks_identical"]


def test_manual_optimization_with_two_optimizers(features: dict[int, dict]) -> None:
    for result in both(features, check_manual_gan):
        assert result["ranks_identical"]
        assert result["steps"] == 2 * 2 * 4  # two optimizers step on each of 4 batches for 2 epochs
        assert result["allreduce_calls"] == result["steps"]  # each optimizer's one bucket, once per step


def test_ddp_style_gan_loop_without_toggle_optimizer_trains_like_the_toggled_one(features: dict[int, dict]) -> None:
    for result in both(features, check_manual_gan_ddp_style):
        assert result["ranks_identical"]
        assert result["steps"] == 2 * 2 * 4
        assert result["max_diff_vs_toggled"] < 1e-12


def test_bf16_mixed_precision_trains_identically_on_all_ranks(features: dict[int, dict]) -> None:
    for result in both(features, check_bf16_mixed):
        assert result["ranks_identical"]
        assert result["loss"] < 0.5 * result["first_loss"]


def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(features: dict[int, dict]) -> None:
    for result in both(features, check_sync_batchnorm):
        assert result["type"] == "SyncBatchNorm"
        assert result["output_diff"] < 1e-10
        assert result["input_grad_diff"] < 1e-10
        assert result["running_mean_diff"] < 1e-6
        assert result["trainer_converted"] and result["ranks_identical"]
        assert result["reverted_after_fit"]  # as Lightning's DDP reverts its SyncBatchNorm after fitting


def test_sync_batchnorm_layers_keep_the_precision_dtype(features: dict[int, dict]) -> None:
    for result in both(features, check_sync_batchnorm):
        # precision="64-true" converts the module to float64 before the BatchNorm layers are swapped
        assert result["trainer_norm_dtypes"] == ["torch.float64"]


def test_epoch_end_averages_buffers_over_ranks(features: dict[int, dict]) -> None:
    for result in both(features, check_average_buffers):
        assert result["buffer_elements"] == 10  # running_mean and running_var of 5 features
        # without averaging the ranks' BatchNorm statistics differ, so the comparison below can fail
        assert result["own_spread_across_ranks"] > 1e-2 and not result["own_ranks_identical"]
        assert result["parameters_diff_between_runs"] == 0.0  # training itself does not read the statistics
        assert result["averaged_ranks_identical"]
        assert result["max_diff_vs_mean_of_own"] < 1e-12


def test_sum_op_and_gradient_predivide_factor_match_one_process_on_the_global_batch(
    features: dict[int, dict],
) -> None:
    for result in both(features, check_reduce_ops):
        assert result["world"] == 2
        for case in ("predivide", "sum"):
            outcome = result[case]
            assert outcome["steps"] == 8 and outcome["ranks_identical"]
            # the first step's gradients: the global batch's mean gradient (x world for op="sum")
            assert outcome["first_gradient_diff"] < 1e-12
            # after 2 epochs of SGD: the single-process run with lr (x world for op="sum")
            assert outcome["max_diff_vs_reference"] < 1e-12
        assert result["predivide"]["max_diff_vs_average_reference"] < 1e-12
        assert result["sum"]["max_diff_vs_average_reference"] > 1e-2  # summing is not averaging


def test_checkpoint_written_by_rank0_only_and_resume_is_identical(features: dict[int, dict]) -> None:
    rank0, rank1 = both(features, check_checkpoint_resume)
    assert rank0["saves"] >= 2 and rank1["saves"] == 0
    assert "last.ckpt" in rank0["files"] and not any(name.endswith(".tmp") for name in rank0["files"])
    for result in (rank0, rank1):
        # the checkpoint holds float64 weights; Lightning loads them into the float32 module before
        # the precision plugin converts it, hence a float32 rounding and not exact zero
        assert result["max_diff_vs_checkpoint"] < 1e-6
        assert result["weights_identical"] and result["adam_state_identical"] and result["final_identical"]
        assert result["adam_steps"] == [8.0, 8.0]  # 2 epochs x 4 batches, restored on both ranks


def test_uneven_batches_do_not_hang(features: dict[int, dict]) -> None:
    rank0, rank1 = both(features, check_uneven_data)
    assert (rank0["batches"], rank1["batches"]) == (10, 6)
    assert rank0["ranks_identical"] and rank1["ranks_identical"]
    assert rank0["steps"] == 20 and rank1["steps"] == 12


def test_uneven_batches_with_sync_batchnorm_do_not_hang(features: dict[int, dict]) -> None:
    # The worker gives up on this check after 120 s and reports a hang instead of blocking the job.
    rank0, rank1 = both(features, check_uneven_sync_batchnorm)
    assert (rank0["batches"], rank1["batches"]) == (10, 6)
    assert rank0["norm_type"] == rank1["norm_type"] == "SyncBatchNorm"
    assert rank0["steps"] == 20 and rank1["steps"] == 12
    assert rank0["ranks_identical"] and rank1["ranks_identical"]


def test_accumulation_schedule_changes_between_epochs(features: dict[int, dict]) -> None:
    for result in both(features, check_accumulation_schedule):
        batches = result["batches"]  # 8 per rank; the model's gradients make one bucket
        assert result["calls_per_epoch"] == [batches, batches // 2, batches // 4]
        assert result["ranks_identical"]


def test_layers_unfrozen_between_epochs_are_averaged_like_the_rest(features: dict[int, dict]) -> None:
    """Lightning's BaseFinetuning: Horovod averages only what was trainable when it wrapped the optimizer."""
    for result in both(features, check_unfrozen_layers_are_averaged):
        for name, case in result.items():
            assert case["ranks_identical"] and case["extra_trained"], (name, case)
            steps = case["steps_per_epoch"]
            # one bucket a step, built again with the unfrozen layers before their first backward
            assert case["calls_per_epoch"] == [steps, steps, steps], (name, case)


def test_manual_optimization_accumulates_without_no_backward_sync(features: dict[int, dict]) -> None:
    """Lightning's manual accumulation (manual_backward each micro-batch, a step every k-th) equals the large batch."""
    for result in both(features, check_manual_accumulation):
        for op, case in result.items():
            assert case["steps"] == 8, (op, case)  # 64 samples / 2 ranks / 4 a micro-batch / k=2, 2 epochs
            assert case["max_diff_vs_large_batch"] < 1e-10, (op, case)
            assert case["ranks_identical"], (op, case)


def test_learning_rate_monitor_tells_two_optimizers_of_one_class_apart(features: dict[int, dict]) -> None:
    """Horovod builds a class per wrapped optimizer; LearningRateMonitor numbers optimizers by class."""
    for result in both(features, check_learning_rate_schedules):
        assert result["rows"] == 4  # 16 samples a rank, batches of 4, logged every step
        assert result["first"] == {"lr-SGD": 0.1, "lr-SGD-1": 0.2}
        assert result["last"] == {"lr-SGD": 0.05, "lr-SGD-1": 0.1}  # StepLR halves every 2 steps
        assert result["optimizer_types_shared"]
        assert result["scheduler_warnings"] == []  # no "optimizer.step() has been overridden"


def test_accumulation_change_inside_an_epoch_is_refused_clearly(features: dict[int, dict]) -> None:
    for result in both(features, check_accumulation_change_mid_epoch):
        assert result["error"] is not None
        assert "accumulate_grad_batches changed to 3 in the middle of epoch 0 (was 1)" in result["error"]


@pytest.fixture(scope="module", params=["gloo", "mpi"], ids=["lightning.pytorch-gloo", "lightning.pytorch-mpi"])
def two_nodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The strategy-level hierarchical checks on two nodes of two workers, under horovodrun --gloo and mpirun."""
    return two_node_reports(request.param, tmp_path_factory, request)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def two_nodes_comm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The same job's checks of the two-level allreduce itself (no Lightning involved)."""
    return two_node_reports(request.param, tmp_path_factory, request)


def test_two_emulated_nodes_have_the_expected_topology(two_nodes: dict[int, dict]) -> None:
    for rank in range(4):
        topology = report_of(two_nodes[rank], check_topology)
        assert topology["nodes"] == [[0, 1], [2, 3]]
        assert topology["local_rank"] == topology["hvd_local_rank"]
        assert topology["node_index"] == topology["hvd_cross_rank"]


def test_node_aware_syncs_keep_the_scripts_plain_init_and_add_no_process_set(two_nodes: dict[int, dict]) -> None:
    for rank in range(4):
        startup = report_of(two_nodes[rank], check_startup)
        assert startup["same_ranks"] and startup["dynamic_env"] is None
        assert startup["process_sets"] == [[0, 1, 2, 3]]  # the global set only: partners are reached by alltoall
        # every hierarchical strategy of the job has trained
        after = report_of(two_nodes[rank], check_still_one_process_set)
        assert after == {"rank": rank, "size": 4, "process_sets": 1}


@pytest.mark.parametrize(
    ("check", "tolerance"),
    [
        pytest.param(fp64_integers, 0.0, id="fp64_integers"),
        pytest.param(fp64_random, 1e-13, id="fp64_random"),
        pytest.param(fp32_random, 1e-5, id="fp32_random"),
        pytest.param(fp32_fp16_wire, 1e-2, id="fp32_fp16_wire"),
        pytest.param(fp32_mixed, 1e-5, id="fp32_mixed"),
        pytest.param(check_two_round_groups, 0.0, id="fp64_two_round_groups"),
    ],
)
def test_hierarchical_allreduce_equals_flat_on_two_nodes(
    two_nodes_comm: dict[int, dict], check: Check, tolerance: float
) -> None:
    for rank in range(4):
        result = report_of(two_nodes_comm[rank], check)
        assert result["max_abs_diff"] <= tolerance * max(1.0, result["max_abs_value"])
        if check in (fp64_integers, check_two_round_groups):
            assert result["exactly_equal"]


def test_hierarchical_bytes_per_leg_on_two_nodes(two_nodes_comm: dict[int, dict]) -> None:
    for rank in range(4):
        fp32 = report_of(two_nodes_comm[rank], fp32_random)
        fp16 = report_of(two_nodes_comm[rank], fp32_fp16_wire)
        padded32 = [5 + 1, 100_001 + 1]  # each buffer padded to a multiple of the 2 local workers
        assert fp32["counters"]["node_local_bytes"] == 4 * sum(n + n // 2 for n in padded32)
        assert fp32["counters"]["cross_node_bytes"] == 4 * sum(n // 2 for n in padded32)
        padded16 = [999 + 1, 4096]
        assert fp16["counters"]["cross_node_bytes"] == 2 * sum(n // 2 for n in padded16)  # fp16 on the wire
        assert fp16["counters"]["node_local_bytes"] == 4 * sum(n + n // 2 for n in padded16)
        # 1,000 elements under the threshold: one flat allreduce, the whole buffer counted as cross-node
        mixed = report_of(two_nodes_comm[rank], fp32_mixed)["counters"]
        assert mixed["cross_node_bytes"] == 4 * (1000 + (100_001 + 1) // 2)
        assert mixed["node_local_bytes"] == 4 * (100_002 + 100_002 // 2)
        assert mixed["cross_node_calls"] == 2 and mixed["node_local_calls"] == 2


def test_hierarchical_times_both_routes_and_every_rank_keeps_the_same_one(two_nodes: dict[int, dict]) -> None:
    for rank in range(4):
        tuning = report_of(two_nodes[rank], check_route_tuning)
        timed = tuning["timed_steps"]  # one warm-up step each, then 2 to 5 timed steps each (fewer when clear)
        assert timed["two_level"] == timed["flat"] and 2 <= timed["flat"] <= 5
        assert tuning["steps"] > 2 + 2 * timed["flat"]
        assert tuning["choices"] in ([1] * 4, [2] * 4)  # decided, and the same on every rank
        assert tuning["vs_flat"] < 1e-12  # float64: either route gives flat's training
    (line,) = two_nodes[0]["route_lines"]  # printed once, by rank 0
    assert "gradients now take" in line


def test_strategy_hierarchical_matches_flat_and_counts_bytes(two_nodes: dict[int, dict]) -> None:
    for rank in range(4):
        result = report_of(two_nodes[rank], check_strategy_modes)
        assert result["hier_vs_flat"] < 1e-12
        assert result["default_vs_flat"] < 1e-12 and result["mixed_vs_flat"] < 1e-12
        assert result["hier_fp16_vs_flat"] < 5e-3 and result["flat_fp16_vs_flat"] < 5e-3
        assert result["hier_ranks_identical"]
        params, steps = result["parameters"], result["steps"]
        assert steps == 16  # 128 samples / 4 ranks / batch 4, 2 epochs
        # flat allreduce over two nodes: the whole gradient crosses nodes at every step
        assert result["flat"]["cross_node_bytes"] == steps * params * 8  # float64
        assert result["flat_fp16"]["cross_node_bytes"] == steps * params * 2
        # two-level: each worker sends half the (padded) gradient across nodes
        half = (params + params % 2) // 2
        assert result["hierarchical"]["cross_node_bytes"] == steps * half * 8
        assert result["hierarchical_fp16"]["cross_node_bytes"] == steps * half * 2
        assert result["hierarchical_accumulated"]["cross_node_bytes"] == result["accumulated_steps"] * half * 8
        assert result["accumulated_steps"] == steps // 2
        # default threshold (1 MiB): this small model's one bucket takes a flat allreduce
        assert result["default"]["cross_node_bytes"] == result["flat"]["cross_node_bytes"]
        assert result["default"]["node_local_bytes"] == 0
        # [96 float64] takes the legs (half crosses), [33 float64] one flat allreduce (all of it crosses)
        assert result["mixed"]["cross_node_bytes"] == steps * (33 + 96 // 2) * 8
        assert result["mixed"]["node_local_bytes"] == steps * (96 + 96 // 2) * 8


def test_buckets_start_their_legs_in_backward_and_train_as_flat(two_nodes: dict[int, dict]) -> None:
    for rank in range(4):
        result = report_of(two_nodes[rank], check_buckets_start_in_backward)
        for accumulate in (1, 2):
            case = result[f"accumulate_{accumulate}"]
            assert case["vs_flat"] < 1e-12
            steps, tensors = case["steps"], case["tensors"]
            assert steps == 16 // accumulate and tensors == 4
            assert case["started"] == steps * tensors  # one sum per bucket and step, no more
            # every bucket but the first layer's weight or bias, whose gradient may come last, starts in backward
            assert case["started_in_backward"] >= steps * (tensors - 1)
        for op in ("average", "sum"):
            manual = result[f"manual_{op}"]
            assert manual["vs_large_batch"] < 1e-12 and manual["ranks_identical"]
        for name in ("new_param_group", "in_place_accumulating", "behind_its_back"):
            unfrozen = result[f"unfrozen_{name}"]
            assert unfrozen["vs_flat"] < 1e-12 and unfrozen["ranks_identical"]
        assert result["unfrozen_behind_its_back"]["extra_trained"]


def compressed_node_local(result: dict[str, Any], local_elements: int) -> None:
    """fp16 on the node-local legs: 2 bytes per element instead of the float64 gradients' 8; cross-node unchanged."""
    compressed, uncompressed, steps = result["counters"], result["uncompressed_node_local_counters"], result["steps"]
    assert uncompressed["node_local_bytes"] == steps * local_elements * 8
    assert compressed["node_local_bytes"] == steps * local_elements * 2
    assert compressed["node_local_calls"] == uncompressed["node_local_calls"]
    assert compressed["cross_node_bytes"] == uncompressed["cross_node_bytes"]
    assert result["vs_flat"] < 5e-3  # fp16 tolerance, as for compression="fp16" alone
    assert result["vs_uncompressed_node_local"] > 0  # the node-local legs really went through fp16
    assert result["ranks_identical"]


def test_compress_node_local_compresses_the_node_local_legs_on_two_nodes(two_nodes: dict[int, dict]) -> None:
    for rank in range(4):
        result = report_of(two_nodes[rank], check_compress_node_local)
        assert result["steps"] == 16
        padded = result["parameters"] + result["parameters"] % 2  # padded to a multiple of the 2 local workers
        compressed_node_local(result, local_elements=padded + padded // 2)  # reduce-scatter + allgather


def test_hierarchical_on_one_node_equals_flat(tmp_path: Path) -> None:
    # what it asserts
    case = case_argument(check_topology, check_startup, fp64_integers, check_strategy_modes, check_compress_node_local)
    job = run_job("hierarchical_checks.py", *case, np=2, out_dir=tmp_path, timeout=600).check()
    for rank in range(2):
        assert report_of(job.results[rank], check_topology)["nodes"] == [[0, 1]]
        startup = report_of(job.results[rank], check_startup)
        assert startup["process_sets"] == [[0, 1]]  # one node: no set beyond the global
        assert report_of(job.results[rank], fp64_integers)["exactly_equal"]
        modes = report_of(job.results[rank], check_strategy_modes)
        assert modes["hier_vs_flat"] < 1e-12 and modes["mixed_vs_flat"] < 1e-12
        assert modes["hierarchical"]["cross_node_bytes"] == 0  # nothing leaves the node
        assert modes["flat"]["cross_node_bytes"] == 0
        # one node: a single node-local allreduce, compressed to fp16 only with compress_node_local=True
        compress = report_of(job.results[rank], check_compress_node_local)
        assert compress["steps"] == 32
        compressed_node_local(compress, local_elements=compress["parameters"])


def test_hierarchical_with_one_worker_per_node_needs_no_process_set(tmp_path: Path) -> None:
    one_per_node = "localhost:1,127.0.0.1:1"
    case = case_argument(check_topology, check_startup, fp64_integers, check_strategy_modes)  # what it asserts
    job = run_job("hierarchical_checks.py", *case, np=2, hosts=one_per_node, out_dir=tmp_path, timeout=600).check()
    for rank in range(2):
        assert report_of(job.results[rank], check_topology)["nodes"] == [[0], [1]]
        startup = report_of(job.results[rank], check_startup)
        assert startup["process_sets"] == [[0, 1]] and startup["dynamic_env"] is None  # the global set only
        assert report_of(job.results[rank], fp64_integers)["exactly_equal"]
        modes = report_of(job.results[rank], check_strategy_modes)
        assert modes["hier_vs_flat"] < 1e-12 and modes["mixed_vs_flat"] < 1e-12
        # one worker per node: the whole gradient crosses nodes, as with flat allreduce
        assert modes["hierarchical"]["cross_node_bytes"] == modes["flat"]["cross_node_bytes"] > 0
        assert modes["hierarchical"]["node_local_bytes"] == 0


def test_single_plain_process(tmp_path: Path) -> None:
    job = run_single("single_process.py", out_dir=tmp_path, timeout=300)
    assert job.returncode == 0, job.output[-3000:]
    result = job.results[0]
    assert result["world_size"] == 1 and result["is_distributed"] is False
    assert result["final_loss"] < 0.5 * result["first_loss"]
    assert result["comm_bytes"] == 0
