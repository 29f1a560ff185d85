"""DASO under real horovodrun jobs on emulated nodes: one job per topology runs every check
(tests/workers/daso_checks.py), and each check is reported, and asserted, by its function."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from _common import Check, report_of
from conftest import two_node_reports
from daso_checks import (
    allreduce_adam,
    allreduce_sgd,
    check_closing_average,
    check_merge_weight,
    daso_adam_fp16,
    daso_adam_per_node_state,
    daso_keeps_cycling_where_it_pays,
    daso_sgd_fp16,
    daso_sgd_fp32,
    daso_stops_cycling_where_it_is_slower,
    daso_two_optimizers,
    daso_unfreeze,
    daso_with_a_layer_one_node_never_uses,
    refuses_iterable_without_length,
    resume_mid_cycling,
)
from hvd_launch import LIGHTNING_PACKAGES, run_job

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.core.comm.cross_node",
    "hvd_plugins.core.comm.shards",
    "hvd_plugins.core.sync.daso.config",
    "hvd_plugins.core.sync.daso.mode",
    "hvd_plugins.core.sync.daso.parameter_sync",
    "hvd_plugins.core.sync.daso.schedule",
    "hvd_plugins.pytorch.callbacks.daso",
)

pytestmark = pytest.mark.multiprocess

TWO_BY_ONE = "localhost:1,127.0.0.1:1"


def check(reports: dict[int, dict], function: Check, rank: int) -> Any:
    """What the check ``function`` returned on ``rank``; fails with that check's error only."""
    return report_of(reports[rank], function)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def two_by_two(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """DASO's checks on two nodes of two workers (horovodrun --gloo on emulated nodes, mpirun on MPI nodes),
    run at the end of the shared two-node job (tests/conftest.py)."""
    return two_node_reports(request.param, tmp_path_factory, request)


@pytest.fixture(scope="module", params=LIGHTNING_PACKAGES)
def two_by_one(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """DASO's checks on two nodes of one worker (resume included), with each Lightning package."""
    out: Path = tmp_path_factory.mktemp("daso_two_by_one")
    job = run_job(
        "daso_checks.py",
        "--topology",
        "two_by_one",
        np=2,
        hosts=TWO_BY_ONE,
        out_dir=out,
        timeout=900,
        lightning=request.param,
    ).check()
    assert sorted(job.results) == [0, 1]
    return job.results


def assert_consistent(daso: dict[str, Any], cycling_steps: bool = True) -> None:
    """Warmup/cooldown steps and every epoch end leave all workers bit-identical; cycling drifts."""
    steps, ends, between = daso["synchronous_steps"], daso["epoch_ends"], daso["between"]
    assert steps["checked"] > 0
    assert steps["params_equal"] == steps["checked"] and steps["state_equal"] == steps["checked"]
    assert ends["checked"] == len(daso["history"])
    assert ends["params_equal"] == ends["state_equal"] == ends["buffers_equal"] == ends["checked"]
    assert daso["phases_seen"] == ["cooldown", "cycling", "warmup"]
    if cycling_steps:
        assert between["checked"] > 0
        assert between["node_agrees"] == between["checked"]  # parameters and optimizer state
        assert between["nodes_differ"] == between["checked"]
        assert daso["merges"] > 0


def assert_one_global_round_per_synchronous_step(daso: dict[str, Any], rounds: int = 1) -> None:
    """Counters per step in warmup/cooldown: ``rounds`` fused gradient tensors across nodes, nothing inside."""
    for phase in ("warmup", "cooldown"):
        stepped = [calls for calls in daso["calls_per_step"][phase] if calls[0] or calls[1]]
        assert stepped and all(calls[:2] == [rounds, 0] for calls in stepped), (phase, stepped)
    assert daso["blocking_syncs_after_epoch"][0] == 0  # no parameter sync at all in warmup


# ---------------------------------------------------------------------------------------------- 2 x 2
def test_two_by_two_synchronous_steps_and_epoch_ends_identical_and_nodes_drift_while_cycling(
    two_by_two: dict[int, dict],
) -> None:
    for rank in range(4):
        assert_consistent(check(two_by_two, daso_adam_fp16, rank))


def test_two_by_two_warmup_is_one_global_fp16_round_per_step(two_by_two: dict[int, dict]) -> None:
    for rank in range(4):
        daso = check(two_by_two, daso_adam_fp16, rank)
        assert_one_global_round_per_synchronous_step(daso)
        flat = check(two_by_two, allreduce_adam, rank)["bytes_per_epoch"][0]["cross_node_bytes"]
        warmup_bytes = sum(calls[2] for calls in daso["calls_per_step"]["warmup"])
        assert warmup_bytes <= flat / 2  # fp16 gradients, the same tensors flat allreduce sends in fp32
        # cycling: one gradient round inside the node per step (plus the allgather of a receive step);
        # across nodes only the sends, one every global_skips=4 steps
        cycling = daso["calls_per_step"]["cycling"]
        assert all(calls[1] in (1, 2) and calls[0] <= 1 for calls in cycling)
        sends = [index for index, calls in enumerate(cycling) if calls[0]]
        assert sends and all(cycling[index + 1][1] == 2 for index in sends)  # received one step later
        assert daso["blocking_syncs_after_epoch"] == [0, 1, 2, 3, 3]  # one closing sync per cycling epoch


def test_schedule_is_fed_the_all_rank_loss_and_logged(two_by_two: dict[int, dict]) -> None:
    histories = [check(two_by_two, daso_adam_fp16, rank)["history"] for rank in range(4)]
    assert all(history == histories[0] for history in histories)  # same loss, same decisions everywhere
    phases = [epoch["phase"] for epoch in histories[0]]
    assert phases[0] == "warmup" and phases[-1] == "cooldown" and "cycling" in phases
    cycling = [epoch for epoch in histories[0] if epoch["phase"] == "cycling"]
    assert (cycling[0]["global_skips"], cycling[0]["batches_to_wait"]) == (4, 1)
    logged = check(two_by_two, daso_adam_fp16, 0)["logged"]
    assert logged["daso/phase"] == 2.0 and logged["daso/global_skips"] == 1.0
    assert logged["daso/epoch_loss"] == pytest.approx(histories[0][-1]["loss"])


def test_daso_reaches_the_loss_of_flat_allreduce(two_by_two: dict[int, dict]) -> None:
    daso_run = check(two_by_two, daso_adam_fp16, 0)
    daso, flat = daso_run["final_loss"], check(two_by_two, allreduce_adam, 0)["final_loss"]
    assert daso < 0.8 * daso_run["history"][0]["loss"]  # it learned
    assert daso == pytest.approx(flat, rel=0.10)


def test_per_node_optimizer_state_skips_the_state_in_cycling_closes_and_averages_it_before_cooldown(
    two_by_two: dict[int, dict],
) -> None:
    """``average_optimizer_state=False``: epochs 1-3 cycle, 4 cools down. The closing syncs of epochs 1 and 2
    leave each node its own Adam state and send fewer bytes; epoch 3's, before cooldown, averages it."""
    for rank in range(4):
        per_node, averaged = check(two_by_two, daso_adam_per_node_state, rank), check(two_by_two, daso_adam_fp16, rank)
        assert [r["phase"] for r in per_node["history"]] == ["warmup", "cycling", "cycling", "cycling", "cooldown"]
        assert per_node["state_equal_per_epoch"] == [True, False, False, True, True]
        assert averaged["state_equal_per_epoch"] == [True] * 5
        assert per_node["epoch_ends"]["params_equal"] == 5  # parameters are averaged at every epoch end
        assert per_node["synchronous_steps"]["state_equal"] == per_node["synchronous_steps"]["checked"] > 0
        for epoch in (1, 2):
            sent, sent_averaged = (run["bytes_per_epoch"][epoch]["cross_node_bytes"] for run in (per_node, averaged))
            assert sent < sent_averaged, (epoch, sent, sent_averaged)
        assert per_node["final_loss"] == pytest.approx(averaged["final_loss"], rel=0.10)


def test_cycling_epoch_sends_at_most_one_global_skip_share_and_fp16_halves_it(two_by_two: dict[int, dict]) -> None:
    for rank in range(4):
        cycling = 1  # warmup_epochs=1, so the second epoch cycles with global_skips=4
        fp16 = check(two_by_two, daso_sgd_fp16, rank)["bytes_per_epoch"][cycling]["cross_node_bytes"]
        fp32 = check(two_by_two, daso_sgd_fp32, rank)["bytes_per_epoch"][cycling]["cross_node_bytes"]
        flat = check(two_by_two, allreduce_sgd, rank)["bytes_per_epoch"][cycling]["cross_node_bytes"]
        assert check(two_by_two, daso_sgd_fp16, rank)["history"][cycling]["global_skips"] == 4
        assert 0 < fp16 <= flat / 4
        assert fp32 <= flat / 4
        assert fp16 == fp32 / 2  # SGD without momentum: only parameters cross the nodes


def assert_closing_average_exact(job: dict[int, dict], ranks: int) -> None:
    """The closing sync averages over all workers; each worker carries only its shard across nodes."""

    def shard(numel: int, local_size: int) -> int:
        return math.ceil(numel / local_size)

    for rank in range(ranks):
        cases = {(c["dtype"], c["downcast"]): c for c in check(job, check_closing_average, rank)["cases"]}
        assert sorted(cases) == [("float32", "fp16"), ("float32", "fp32"), ("float64", "fp32")]
        for case in cases.values():
            assert case["blocking"]
            assert case["param_error"] == case["momentum_error"] == case["buffer_error"] == 0.0, case
        n, local = cases[("float64", "fp32")]["numel"], cases[("float64", "fp32")]["local_size"]
        # one message per wire type: a shard of each crosses; the buffers, all of them
        per_message = {
            ("float64", "fp32"): shard(n, local) * 4 + shard(n, local) * 8,  # fp32 parameters, float64 momentum
            ("float32", "fp32"): shard(2 * n, local) * 4,  # parameters and momentum in one float32 message
            ("float32", "fp16"): shard(n, local) * 2 + shard(n, local) * 4,
        }
        for key, expected in per_message.items():
            assert cases[key]["cross_node_bytes"] == expected + cases[key]["buffer_bytes"], cases[key]


def assert_merge_weight_exact(job: dict[int, dict], ranks: int) -> None:
    """The non-blocking merge equals ``(2B * p_local + S) / (2B + N)`` for B = 1 and 2 (see check_merge_weight)."""
    for rank in range(ranks):
        result = check(job, check_merge_weight, rank)
        assert result["nodes"] == 2 and result["downcast"] == "fp32" and result["merges"] == 2
        cases = result["cases"]
        assert [(case["global_skips"], case["batches_to_wait"]) for case in cases] == [(4, 1), (8, 2)]
        for case in cases:
            assert not case["idle_steps_communicated"]
            assert case["send_plan"] == [True, False, False]  # send, no receive, not blocking
            assert case["receive_plan"] == [True, False, case["batches_to_wait"]]  # merged, not superseded
            assert case["error"] < 1e-6
            # other weights would have given other parameters (B + 1 equals 2B only for B = 1)
            assert case["error_if_weight_b"] > 0.1
            assert case["error_if_plain_average"] > 0.1 and case["error_if_local_kept"] > 0.1
        assert cases[1]["error_if_weight_b_plus_1"] > 0.05


def test_merge_weight_is_exact_on_two_nodes_of_two(two_by_two: dict[int, dict]) -> None:
    assert_merge_weight_exact(two_by_two, ranks=4)


def test_closing_sync_is_the_average_over_all_workers_on_two_nodes_of_two(two_by_two: dict[int, dict]) -> None:
    assert_closing_average_exact(two_by_two, ranks=4)


# ---------------------------------------------------------------------------------------------- 2 x 1
def test_merge_weight_is_exact_with_one_worker_per_node(two_by_one: dict[int, dict]) -> None:
    assert_merge_weight_exact(two_by_one, ranks=2)


def test_closing_sync_is_the_average_over_all_workers_with_one_worker_per_node(two_by_one: dict[int, dict]) -> None:
    assert_closing_average_exact(two_by_one, ranks=2)


def test_one_worker_per_node_with_a_layer_one_node_never_uses_and_accumulation(two_by_one: dict[int, dict]) -> None:
    """Zero-filled gradients give node 1 Adam state for node 0's layer, so the blocking syncs match."""
    for rank in range(2):
        daso = check(two_by_one, daso_with_a_layer_one_node_never_uses, rank)
        assert_consistent(daso)
        assert_one_global_round_per_synchronous_step(daso)
        warmup = daso["calls_per_step"]["warmup"]
        assert [calls[0] for calls in warmup[:4]] == [0, 1, 0, 1]  # two micro-batches, one average


def test_two_optimizers_each_average_once_per_step(two_by_one: dict[int, dict]) -> None:
    for rank in range(2):
        daso = check(two_by_one, daso_two_optimizers, rank)
        assert_consistent(daso)
        assert_one_global_round_per_synchronous_step(daso, rounds=2)


def test_parameters_unfrozen_between_epochs_join_the_cross_node_sync(two_by_one: dict[int, dict]) -> None:
    for rank in range(2):
        daso = check(two_by_one, daso_unfreeze, rank)
        assert_consistent(daso)  # the unfrozen layer trains while cycling, and still ends every epoch equal
        synced = daso["synced_parameters_per_epoch"]
        assert synced[1] < synced[2] == synced[3]  # unfrozen at the start of epoch 2
        assert daso["history"][2]["phase"] == "cycling"


def test_iterable_dataset_without_length_is_refused_on_every_rank(two_by_one: dict[int, dict]) -> None:
    for rank in range(2):
        error = check(two_by_one, refuses_iterable_without_length, rank)
        assert "sync='daso' needs to know how many training batches" in error
        assert "(Stream)" in error and "__len__" in error and "limit_train_batches" in error


def test_resume_mid_cycling_continues_like_an_uninterrupted_run(two_by_one: dict[int, dict]) -> None:
    for rank in range(2):
        resume = check(two_by_one, resume_mid_cycling, rank)
        whole, interrupted = resume["whole_history"], resume["interrupted_history"]
        assert len(interrupted) == 4 and interrupted == whole[:4]
        assert interrupted[-1][1] == "cycling"  # the checkpoint was taken while cycling
        # the schedule moved after the resume: the detector's count survived the checkpoint
        assert whole[4][2:4] != whole[5][2:4] and whole[5][1] == "cycling"
        assert resume["resumed_history"] == whole
        assert resume["interrupted_vs_whole_diff"] > 1e-3  # the comparison below can fail
        assert resume["max_parameter_diff"] < 1e-6


def test_auto_cycling_stops_where_cycling_steps_are_slower_and_goes_on_where_they_pay(
    two_by_one: dict[int, dict],
) -> None:
    for rank in (0, 1):
        declined = check(two_by_one, daso_stops_cycling_where_it_is_slower, rank)
        assert [epoch["phase"] for epoch in declined["history"]] == ["warmup", "cycling", "synchronous", "cooldown"]
        # the synchronous epoch averages every step over all workers: identical parameters and state
        assert declined["epoch_ends"]["checked"] == declined["epoch_ends"]["params_equal"] == 4
        assert declined["epoch_ends"]["state_equal"] == 4
        kept = check(two_by_one, daso_keeps_cycling_where_it_pays, rank)
        assert [epoch["phase"] for epoch in kept["history"]] == ["warmup", "cycling", "cycling", "cooldown"]
