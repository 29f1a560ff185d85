"""Sharded training on real workers: equal to unsharded, 1/N of the state, consolidated checkpoints, clear refusals.

One job of four workers on two emulated nodes (tests/workers/sharded_checks.py) runs every check; a job
of two workers resumes the checkpoint the four saved. The same worker written for ``pytorch_lightning``
runs the checks of the state held, of the refusals and one short equality, on four workers too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _common import case_argument, report_of
from hvd_launch import LIGHTNING_PACKAGES, TWO_NODES, run_job, run_single
from sharded_checks import (
    CASES,
    check_a_short_run_equals_unsharded,
    check_equal_to_unsharded,
    check_inside_the_node,
    check_partition,
    check_parts_checkpoint,
    check_refusals,
    check_save_for_resume,
    check_sixteen_mixed,
    check_two_optimizers_and_unfreezing,
)

COVERS = (
    "hvd_plugins.consolidate",
    "hvd_plugins.core.sync.sharded.mode",
    "hvd_plugins.core.sync.sharded.optimizer",
    "hvd_plugins.core.sync.sharded.partition",
)
"""The modules these real jobs exercise beyond their unit files."""

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
"""Of the largest parameter, in float32: the order of the sums is the only difference."""
FP16_TOLERANCE = 2e-4
"""With float16 on the wire each sum rounds to float16 (2**-11 relative) in an order that differs: the unsharded
allreduce adds float16 pieces in Horovod's ring order, ZeRO-2 adds them in float32 in rank order (measured after
50 Adam steps: 2.3e-5 for ZeRO-1, 7.1e-5 for ZeRO-2)."""


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded")
    job = run_job("sharded_checks.py", np=4, hosts=TWO_NODES, out_dir=out, timeout=900)
    job.check()
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    return job.results


STANDALONE_CHECKS = (check_partition, check_refusals, check_a_short_run_equals_unsharded)
"""What the job for ``pytorch_lightning`` runs: the cheap checks, the same code through the other package."""


@pytest.fixture(scope="module", params=LIGHTNING_PACKAGES)
def each_package(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Every rank's report with each Lightning package: the job above for ``lightning.pytorch``; for
    ``pytorch_lightning`` one of four workers on two nodes that runs ``STANDALONE_CHECKS`` only."""
    if request.param == "lightning.pytorch":
        reports: dict[int, dict[str, Any]] = request.getfixturevalue("four")
        return reports
    out = tmp_path_factory.mktemp("sharded_pytorch_lightning")
    job = run_job(
        "sharded_checks.py",
        *case_argument(*STANDALONE_CHECKS),
        np=4,
        hosts=TWO_NODES,
        out_dir=out,
        timeout=600,
        lightning="pytorch_lightning",
    )
    job.check()
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    return job.results


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_training_equals_unsharded(four: dict[int, dict[str, Any]], case: str) -> None:
    tolerance = FP16_TOLERANCE if case == "fp16_wire" else TOLERANCE
    for rank in range(4):
        found = report_of(four[rank], check_equal_to_unsharded)[case]
        assert found["optimizer"] <= tolerance and found["gradients"] <= tolerance, found


def test_a_short_clipped_run_with_a_scheduler_equals_unsharded_under_each_package(
    each_package: dict[int, dict[str, Any]],
) -> None:
    for rank in range(4):
        found = report_of(each_package[rank], check_a_short_run_equals_unsharded)
        assert found["optimizer"] <= TOLERANCE and found["gradients"] <= TOLERANCE, found


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_inside_the_node_equals_flat_sharding_with_half_the_state_and_no_more_cross_node_bytes(
    four: dict[int, dict[str, Any]], shard: str
) -> None:
    for rank in range(4):
        report = report_of(four[rank], check_inside_the_node)
        found = report[shard]
        assert found["from_flat_sharding"] <= TOLERANCE and found["from_unsharded"] <= TOLERANCE, found
        assert found["identical_across_workers"], found
        assert found["shard_world"] == 2, "split over the two workers of each node"
        assert found["state_bytes"] <= found["whole_state_bytes"] / 2 + 1024, found  # 1/L, and bucket padding
        assert 0 < found["cross_bytes"] <= report["two_level_cross_bytes"], (found, report["two_level_cross_bytes"])
    parts = report_of(four[0], check_inside_the_node)["parts"]
    assert parts["files"] == [f"inside_node_parts.ckpt.optimizer-part-{r}-of-2" for r in range(2)], parts
    assert parts["parts_vs_full"] <= TOLERANCE, parts  # the first node's parts, consolidated on load


@pytest.mark.parametrize("case", ["gan", "unfreeze"])
def test_two_optimizers_and_an_unfrozen_layer_train_as_unsharded(four: dict[int, dict[str, Any]], case: str) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_two_optimizers_and_unfreezing)[case]
        assert found["optimizer"] <= TOLERANCE and found["gradients"] <= TOLERANCE, found


def test_each_worker_holds_a_quarter_of_the_optimizer_state(each_package: dict[int, dict[str, Any]]) -> None:
    for rank in range(4):
        found = report_of(each_package[rank], check_partition)
        whole = found["none"]["state_bytes"]
        assert whole == 2 * 4 * found["none"]["parameters"]  # Adam's two float32 moments
        for shard in ("optimizer", "gradients"):
            share = found[shard]["state_bytes"]
            padding = 2 * 4 * 3 * found[shard]["slices"]  # at most N - 1 padded elements a bucket, two moments
            assert whole / 4 <= share <= whole / 4 + padding, (shard, share, whole)
            assert found[shard]["identical_across_workers"]
        assert found["gradients"]["whole_gradients_left"] == 0  # ZeRO-2 keeps only its slices
        monitored = {shard: found[shard]["monitor"] for shard in ("none", "optimizer", "gradients")}
        step_counts = 4 * found["gradients"]["slices"] / 2**20  # a float32 step count per slice
        assert abs(monitored["gradients"]["optimizer_state_mb"] - step_counts - whole / 4 / 2**20) <= padding / 2**20
        assert monitored["none"]["gradients_mb"] == monitored["none"]["parameters_mb"]  # PeakMemoryMonitor sees it
        assert monitored["gradients"]["gradients_mb"] <= monitored["none"]["gradients_mb"] / 4 + padding / 2**20
        assert found["optimizer"]["whole_gradients_left"] == found["none"]["whole_gradients_left"]


def test_a_sharded_checkpoint_holds_the_whole_state_and_resumes_on_two_workers_and_one_process(
    four: dict[int, dict[str, Any]], tmp_path: Path
) -> None:
    saved = report_of(four[0], check_save_for_resume)
    assert saved["same_layout"] and saved["state_difference"] <= 1e-5
    checkpoint = saved["paths"]["gradients"]
    parts = report_of(four[0], check_parts_checkpoint)["path"]
    args = ("--resume", checkpoint, "--resume-parts", parts)
    job = run_job("sharded_checks.py", *args, np=2, out_dir=tmp_path / "two", timeout=600)
    job.check()
    for rank in range(2):
        assert job.results[rank]["resume"]["value"]["vs_unsharded"] <= TOLERANCE
        assert job.results[rank]["resume"]["value"]["parts_vs_full"] == 0.0  # the same state, consolidated
    single = run_single("sharded_checks.py", "--resume-single", checkpoint, out_dir=tmp_path / "one", timeout=300)
    single.check()
    found = single.results[0]["resume_single"]["value"]
    assert found["epochs"] == 4 and found["horovod"] is False and found["optimizer"] == "AdamW"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("adasum", ["shard='gradients' does not work with op='adasum'"]),
        ("daso", ["shard='optimizer' does not work with sync='daso'", "sync='hierarchical' with shard="]),
        ("hierarchical_native", ["needs hierarchical_impl='portable'", "not 'native'"]),
        ("unknown", ["shard='everything' is not supported", "'none', 'optimizer', 'gradients', 'parameters'"]),
        ("lbfgs", ["cannot shard LBFGS: it needs whole parameters"]),
        ("sparse", ["cannot shard sparse gradients", "Embedding(sparse=True)"]),
    ],
)
def test_what_sharding_cannot_do_is_refused_before_training(
    each_package: dict[int, dict[str, Any]], case: str, words: list[str]
) -> None:
    for rank in range(4):
        message = report_of(each_package[rank], check_refusals)[case]
        assert all(word in message for word in words), message


def test_16_mixed_trains_as_unsharded(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_sixteen_mixed)
        assert found["optimizer"] <= TOLERANCE and found["gradients"] <= TOLERANCE, found


def test_a_checkpoint_in_parts_resumes_the_same_workers_from_their_own_parts_and_consolidates_for_one_process(
    four: dict[int, dict[str, Any]], tmp_path: Path
) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_parts_checkpoint)
        assert found["marker"] == {"format": "hvd_plugins.optimizer_parts/1", "workers": 4, "optimizers": 1}
        assert found["parts_vs_full"] == 0.0  # own parts restore what the whole state restores, bit for bit
    parts = Path(report_of(four[0], check_parts_checkpoint)["path"])
    assert sorted(p.name for p in parts.parent.glob(parts.name + ".optimizer-part-*")) == [
        f"{parts.name}.optimizer-part-{rank}-of-4" for rank in range(4)
    ]
    whole = tmp_path / "whole.ckpt"
    done = subprocess.run(
        [sys.executable, "-m", "hvd_plugins.consolidate", str(parts), "-o", str(whole)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    single = run_single("sharded_checks.py", "--resume-single", str(whole), out_dir=tmp_path / "one", timeout=300)
    single.check()
    assert single.results[0]["resume_single"]["value"]["epochs"] == 4
