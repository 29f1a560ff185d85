"""op="adasum" under the MPI controller: the reduction is Adasum's, training works, impossible settings are refused.

Adasum needs Horovod's MPI controller, so these jobs run under ``horovodrun --mpi`` and are skipped,
with the reason, where OpenMPI or an MPI build of Horovod is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hvd_launch import run_job

from hvd_plugins.testing.launch import mpi_launch_problem

pytestmark = [pytest.mark.multiprocess, pytest.mark.mpi]


@pytest.fixture(scope="module", params=[2, 4], ids=["2_workers", "4_workers"])
def adasum(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    problem = mpi_launch_problem()
    if problem is not None:
        pytest.skip(f"op='adasum' needs horovodrun --mpi: {problem}")
    out: Path = tmp_path_factory.mktemp(f"adasum_{request.param}")
    job = run_job("adasum_checks.py", np=request.param, out_dir=out, timeout=420, controller="mpi").check()
    assert sorted(job.results) == list(range(request.param)), job.output[-3000:]
    return job.results


def value(report: dict[str, Any], check: str) -> Any:
    entry = report[check]
    assert entry["ok"], f"check {check!r} failed: {entry['error']}\n{entry['trace']}"
    return entry["value"]


def test_the_reduction_is_adasum_applied_to_pairs_of_workers(adasum: dict[int, dict]) -> None:
    for report in adasum.values():
        assert report["mpi_enabled"]
        result = value(report, "definition")
        assert result["relative_error"] < 1e-9, result
        assert result["differs_from_sum"] > 0.1  # the check can tell Adasum from a plain sum
        assert result["identical_inputs_error"] < 1e-12  # Adasum(a, a) = a


def test_training_with_adasum_converges_and_ranks_stay_identical(adasum: dict[int, dict]) -> None:
    for report in adasum.values():
        result = value(report, "training")
        assert result["ranks_identical"] and result["steps"] > 0
        assert result["final_loss"] < 0.5 * result["first_loss"], result


def test_accumulation_and_clipping_are_refused_before_the_first_step(adasum: dict[int, dict]) -> None:
    for report in adasum.values():
        assert "op='adasum' cannot accumulate gradients (accumulate_grad_batches=2)" in value(
            report, "accumulation_refused"
        )
        assert "op='adasum' cannot clip gradients" in value(report, "clipping_refused")
