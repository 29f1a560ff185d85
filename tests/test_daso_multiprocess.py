"""DASO under real horovodrun jobs on emulated nodes (see tests/workers/daso_training.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hvd_launch import TWO_NODES, JobResult, run_job

pytestmark = pytest.mark.multiprocess


def values(job: JobResult, rank: int) -> dict[str, Any]:
    checks = job.results[rank]["checks"]
    failed = {name: check["error"] + "\n" + check["trace"] for name, check in checks.items() if not check["ok"]}
    assert not failed, failed
    return {name: check["value"] for name, check in checks.items()}


@pytest.fixture(scope="module")
def two_nodes_of_two(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    out: Path = tmp_path_factory.mktemp("daso_two_nodes")
    job = run_job("daso_training.py", np=4, hosts=TWO_NODES, out_dir=out, timeout=900).check()
    assert sorted(job.results) == [0, 1, 2, 3]
    return job


def test_blocking_syncs_leave_every_worker_identical_and_nodes_drift_in_between(two_nodes_of_two: JobResult) -> None:
    for rank in range(4):
        daso = values(two_nodes_of_two, rank)["daso_adam_fp16"]
        blocking, between = daso["after_blocking"], daso["between"]
        assert blocking["checked"] >= 2 * 16  # warmup and cooldown: one check per batch
        assert blocking["params_equal"] == blocking["checked"]
        assert blocking["state_equal"] == blocking["checked"]  # Adam's moments
        assert blocking["buffers_equal"] == blocking["checked"]  # BatchNorm running stats
        assert between["checked"] > 0
        assert between["node_agrees"] == between["checked"]
        assert between["nodes_differ"] == between["checked"]
        assert daso["phases_seen"] == ["cooldown", "cycling", "warmup"]
        assert daso["merges"] > 0


def test_schedule_is_fed_the_all_rank_loss_and_logged(two_nodes_of_two: JobResult) -> None:
    histories = [values(two_nodes_of_two, rank)["daso_adam_fp16"]["history"] for rank in range(4)]
    assert all(history == histories[0] for history in histories)  # same loss, same decisions everywhere
    phases = [epoch["phase"] for epoch in histories[0]]
    assert phases[0] == "warmup" and phases[-1] == "cooldown" and "cycling" in phases
    cycling = [epoch for epoch in histories[0] if epoch["phase"] == "cycling"]
    assert (cycling[0]["global_skips"], cycling[0]["batches_to_wait"]) == (4, 1)
    logged = values(two_nodes_of_two, 0)["daso_adam_fp16"]["logged"]
    assert logged["daso/phase"] == 2.0 and logged["daso/global_skips"] == 1.0
    assert logged["daso/epoch_loss"] == pytest.approx(histories[0][-1]["loss"])


def test_daso_reaches_the_loss_of_flat_allreduce(two_nodes_of_two: JobResult) -> None:
    results = values(two_nodes_of_two, 0)
    daso, flat = results["daso_adam_fp16"]["final_loss"], results["allreduce_adam"]["final_loss"]
    first_epoch = results["daso_adam_fp16"]["history"][0]["loss"]
    assert daso < 0.8 * first_epoch  # it learned
    # Measured: DASO ends 7-8 % above flat allreduce after 5 epochs (3 cycling) on this task; the nodes
    # take 4 local steps between partial merges, which costs some progress this early in training.
    assert daso == pytest.approx(flat, rel=0.10)


def test_cycling_epoch_sends_at_most_one_global_skip_share_and_fp16_halves_it(two_nodes_of_two: JobResult) -> None:
    for rank in range(4):
        results = values(two_nodes_of_two, rank)
        cycling = 1  # warmup_epochs=1, so the second epoch cycles with global_skips=4
        fp16 = results["daso_sgd_fp16"]["bytes_per_epoch"][cycling]["cross_node_bytes"]
        fp32 = results["daso_sgd_fp32"]["bytes_per_epoch"][cycling]["cross_node_bytes"]
        flat = results["allreduce_sgd"]["bytes_per_epoch"][cycling]["cross_node_bytes"]
        assert results["daso_sgd_fp16"]["history"][cycling]["global_skips"] == 4
        assert 0 < fp16 <= flat / 4
        assert fp32 <= flat / 4
        assert fp16 == fp32 / 2  # SGD without momentum: only parameters cross the nodes


def check_merge_weight_exact(job: JobResult, ranks: int) -> None:
    """The non-blocking merge equals ``(2B * p_local + S) / (2B + N)`` for B = 1 and 2 (see check_merge_weight)."""
    for rank in range(ranks):
        check = job.results[rank]["checks"]["merge_weight"]  # this check only: the others have their own tests
        assert check["ok"], check["error"] + "\n" + check["trace"]
        result = check["value"]
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


def test_merge_weight_is_exact_on_two_nodes_of_two(two_nodes_of_two: JobResult) -> None:
    check_merge_weight_exact(two_nodes_of_two, ranks=4)


@pytest.fixture(scope="module")
def one_worker_per_node(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    out: Path = tmp_path_factory.mktemp("daso_one_per_node")
    job = run_job("daso_training.py", "--case", "lean", np=2, hosts="localhost:1,127.0.0.1:1", out_dir=out)
    return job.check()


def test_merge_weight_is_exact_with_one_worker_per_node(one_worker_per_node: JobResult) -> None:
    check_merge_weight_exact(one_worker_per_node, ranks=2)


def test_one_worker_per_node(one_worker_per_node: JobResult) -> None:
    job = one_worker_per_node
    for rank in range(2):
        daso = values(job, rank)["daso"]
        blocking, between = daso["after_blocking"], daso["between"]
        assert blocking["checked"] > 0 and blocking["params_equal"] == blocking["checked"]
        assert blocking["state_equal"] == blocking["checked"] and blocking["buffers_equal"] == blocking["checked"]
        assert between["checked"] > 0 and between["nodes_differ"] == between["checked"]
        assert daso["merges"] > 0


def test_resume_mid_cycling_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    job = run_job("daso_resume.py", np=2, hosts="localhost:1,127.0.0.1:1", out_dir=tmp_path, timeout=600).check()
    for rank in range(2):
        resume = values(job, rank)["resume"]
        whole, interrupted = resume["whole_history"], resume["interrupted_history"]
        assert len(interrupted) == 4 and interrupted == whole[:4]
        assert interrupted[-1][1] == "cycling"  # the checkpoint was taken while cycling
        assert len({tuple(record[2:4]) for record in whole if record[1] == "cycling"}) > 1  # the schedule moved
        assert resume["resumed_history"] == whole
        assert resume["interrupted_vs_whole_diff"] > 1e-3  # the comparison below can fail
        assert resume["max_parameter_diff"] < 1e-6
