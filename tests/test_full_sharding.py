"""Full sharding (``shard="parameters"``) on real workers: equal to unsharded training, each worker holding only
the parameters of no unit between computations, whole checkpoints that resume, and clear refusals.

One job of four workers on two emulated nodes (tests/workers/full_shard_checks.py) runs every check; the
same worker written for ``pytorch_lightning`` runs a short equality and the refusals.
"""

from __future__ import annotations

from typing import Any

import pytest
from _common import case_argument, report_of
from full_shard_checks import (
    CASES,
    check_a_short_run_equals_unsharded,
    check_equal_to_unsharded,
    check_refusals,
    check_validation_predict_and_checkpoint,
)
from hvd_launch import LIGHTNING_PACKAGES, TWO_NODES, run_job

COVERS = (
    "hvd_plugins.core.sync.sharded.stages",
    "hvd_plugins.core.sync.sharded.units",
)
"""The modules these real jobs exercise beyond their unit files."""

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
"""Of the largest parameter, in float32: the order of the sums is the only difference."""


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("full_shard")
    job = run_job("full_shard_checks.py", np=4, hosts=TWO_NODES, out_dir=out, timeout=900)
    job.check()
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    return job.results


@pytest.fixture(scope="module", params=LIGHTNING_PACKAGES)
def each_package(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """The job above for ``lightning.pytorch``; for ``pytorch_lightning`` one that runs the short equality and the
    refusals only."""
    if request.param == "lightning.pytorch":
        reports: dict[int, dict[str, Any]] = request.getfixturevalue("four")
        return reports
    out = tmp_path_factory.mktemp("full_shard_pytorch_lightning")
    job = run_job(
        "full_shard_checks.py",
        *case_argument(check_a_short_run_equals_unsharded, check_refusals),
        np=4,
        hosts=TWO_NODES,
        out_dir=out,
        timeout=600,
        lightning="pytorch_lightning",
    )
    job.check()
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    return job.results


def test_a_short_clipped_run_with_a_scheduler_equals_unsharded_under_each_package(
    each_package: dict[int, dict[str, Any]],
) -> None:
    for rank in range(4):
        found = report_of(each_package[rank], check_a_short_run_equals_unsharded)
        assert found["difference"] <= TOLERANCE and found["held"] < found["whole"], found


@pytest.mark.parametrize("case", sorted(CASES))
def test_fully_sharded_training_equals_unsharded_and_holds_only_what_no_unit_owns(
    four: dict[int, dict[str, Any]], case: str
) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_equal_to_unsharded)[case]
        assert found["difference"] <= TOLERANCE, found
        assert found["held"] < found["whole"], found  # the Blocks' parameters are slices between computations


def test_validation_predict_and_a_whole_checkpoint_that_resumes_sharded(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_validation_predict_and_checkpoint)
        assert found["validated"] <= 1e-5 and found["predicted"] <= 1e-5, found
        assert found["checkpoint_whole"], found
        assert found["resumed"] <= TOLERANCE, found


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("hierarchical", ["shard='parameters' works with sync='allreduce' only", "sync='hierarchical'"]),
        ("elastic", ["shard='parameters' does not work with elastic=True"]),
        ("policy_without_full_sharding", ["auto_wrap_policy={", "works only with shard='parameters'"]),
        ("no_unit", ["shard='parameters' found no unit in UnitNet", "auto_wrap_policy={Block}"]),
    ],
)
def test_what_full_sharding_cannot_do_is_refused_before_training(
    each_package: dict[int, dict[str, Any]], case: str, words: list[str]
) -> None:
    for rank in range(4):
        message = report_of(each_package[rank], check_refusals)[case]
        assert all(word in message for word in words), message
