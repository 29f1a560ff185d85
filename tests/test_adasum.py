"""op="adasum" under the MPI controller: the reduction is Adasum's, training works, impossible settings are refused.

Adasum needs Horovod's MPI controller, so these checks run inside the suite's MPI jobs (two workers under
``horovodrun --mpi``, and two MPI nodes of two workers under mpirun) and are skipped, with the reason,
where OpenMPI or an MPI build of Horovod is missing.
"""

from __future__ import annotations

import pytest
from _common import report_of
from adasum_checks import (
    adasum_definition,
    adasum_refuses_accumulation,
    adasum_refuses_clipping,
    adasum_runs_on_mpi,
    adasum_training,
    adasum_unfrozen_layer,
)
from conftest import two_node_reports, two_worker_reports

from hvd_plugins.testing.launch import mpi_launch_problem

pytestmark = [pytest.mark.multiprocess, pytest.mark.mpi]


@pytest.fixture(scope="module", params=[2, 4], ids=["2_workers", "4_workers"])
def adasum(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Every rank's report of the MPI jobs that run Adasum's checks (tests/workers/adasum_checks.py) with their
    own (tests/conftest.py): two workers on one node, and two MPI nodes of two workers."""
    problem = mpi_launch_problem()
    if problem is not None:
        pytest.skip(f"op='adasum' needs horovodrun --mpi: {problem}")
    if request.param == 2:
        reports = two_worker_reports("lightning.pytorch", tmp_path_factory, controller="mpi")
    else:
        reports = two_node_reports("mpi", tmp_path_factory, request)
    assert sorted(reports) == list(range(request.param))
    return reports


def test_the_reduction_is_adasum_applied_to_pairs_of_workers(adasum: dict[int, dict]) -> None:
    for report in adasum.values():
        assert report_of(report, adasum_runs_on_mpi)["mpi_enabled"]
        result = report_of(report, adasum_definition)
        assert result["relative_error"] < 1e-9, result
        assert result["differs_from_sum"] > 0.1  # the check can tell Adasum from a plain sum
        assert result["identical_inputs_error"] < 1e-12  # Adasum(a, a) = a


def test_training_with_adasum_converges_and_ranks_stay_identical(adasum: dict[int, dict]) -> None:
    for report in adasum.values():
        result = report_of(report, adasum_training)
        assert result["ranks_identical"] and result["steps"] > 0
        assert result["final_loss"] < 0.5 * result["first_loss"], result


def test_a_layer_unfrozen_mid_training_trains_and_ranks_stay_identical(adasum: dict[int, dict]) -> None:
    for report in adasum.values():
        for case, result in report_of(report, adasum_unfrozen_layer).items():
            assert result == {"extra_trained": True, "ranks_identical": True}, (case, result)


def test_accumulation_and_clipping_are_refused_before_the_first_step(adasum: dict[int, dict]) -> None:
    for report in adasum.values():
        refused = report_of(report, adasum_refuses_accumulation)
        assert "op='adasum' cannot accumulate gradients (accumulate_grad_batches=2)" in refused
        assert "op='adasum' cannot clip gradients" in report_of(report, adasum_refuses_clipping)
