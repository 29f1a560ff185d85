"""Sharded training on real workers: equal to unsharded, 1/N of the state, consolidated checkpoints, clear refusals.

One job of four workers on two emulated nodes (tests/workers/sharded_checks.py) runs every check; a job
of two workers resumes the checkpoint the four saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _common import report_of
from hvd_launch import TWO_NODES, run_job, run_single
from sharded_checks import (
    CASES,
    check_equal_to_unsharded,
    check_partition,
    check_refusals,
    check_save_for_resume,
    check_two_optimizers_and_unfreezing,
)

COVERS = (
    "hvd_plugins.core.sync.sharded.mode",
    "hvd_plugins.core.sync.sharded.optimizer",
    "hvd_plugins.core.sync.sharded.partition",
)
"""The modules these real jobs exercise beyond their unit files."""
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_training_equals_unsharded(four: dict[int, dict[str, Any]], case: str) -> None:
    tolerance = FP16_TOLERANCE if case == "fp16_wire" else TOLERANCE
    for rank in range(4):
        found = report_of(four[rank], check_equal_to_unsharded)[case]
        assert found["optimizer"] <= tolerance and found["gradients"] <= tolerance, found


@pytest.mark.parametrize("case", ["gan", "unfreeze"])
def test_two_optimizers_and_an_unfrozen_layer_train_as_unsharded(four: dict[int, dict[str, Any]], case: str) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_two_optimizers_and_unfreezing)[case]
        assert found["optimizer"] <= TOLERANCE and found["gradients"] <= TOLERANCE, found


def test_each_worker_holds_a_quarter_of_the_optimizer_state(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_partition)
        whole = found["none"]["state_bytes"]
        assert whole == 2 * 4 * found["none"]["parameters"]  # Adam's two float32 moments
        for shard in ("optimizer", "gradients"):
            share = found[shard]["state_bytes"]
            padding = 2 * 4 * 3 * found[shard]["slices"]  # at most N - 1 padded elements a bucket, two moments
            assert whole / 4 <= share <= whole / 4 + padding, (shard, share, whole)
            assert found[shard]["identical_across_workers"]
        assert found["gradients"]["whole_gradients_left"] == 0  # ZeRO-2 keeps only its slices
        assert found["optimizer"]["whole_gradients_left"] == found["none"]["whole_gradients_left"]


def test_a_sharded_checkpoint_holds_the_whole_state_and_resumes_on_two_workers_and_one_process(
    four: dict[int, dict[str, Any]], tmp_path: Path
) -> None:
    saved = report_of(four[0], check_save_for_resume)
    assert saved["same_layout"] and saved["state_difference"] <= 1e-5
    checkpoint = saved["paths"]["gradients"]
    job = run_job("sharded_checks.py", "--resume", checkpoint, np=2, out_dir=tmp_path / "two", timeout=600)
    job.check()
    for rank in range(2):
        assert job.results[rank]["resume"]["value"]["vs_unsharded"] <= TOLERANCE
    single = run_single("sharded_checks.py", "--resume-single", checkpoint, out_dir=tmp_path / "one", timeout=300)
    single.check()
    found = single.results[0]["resume_single"]["value"]
    assert found["epochs"] == 4 and found["horovod"] is False and found["optimizer"] == "AdamW"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("adasum", ["shard='gradients' does not work with op='adasum'"]),
        ("daso", ["shard='optimizer' works with sync='allreduce', not sync='daso'"]),
        ("hierarchical", ["shard='optimizer' works with sync='allreduce', not sync='hierarchical'"]),
        ("unknown", ["shard='parameters' is not supported", "'none', 'optimizer', 'gradients'"]),
        ("lbfgs", ["cannot shard LBFGS: it needs whole parameters"]),
        ("sparse", ["cannot shard sparse gradients", "Embedding(sparse=True)"]),
    ],
)
def test_what_sharding_cannot_do_is_refused_before_training(
    four: dict[int, dict[str, Any]], case: str, words: list[str]
) -> None:
    for rank in range(4):
        message = report_of(four[rank], check_refusals)[case]
        assert all(word in message for word in words), message
