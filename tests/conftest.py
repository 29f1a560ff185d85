"""The two tiers of the suite, and the shared jobs of the multi-process one.

``tests/unit/`` mirrors ``hvd_plugins/``: in-process tests, marked ``unit`` here (``pytest -m unit``
runs them alone, in well under a minute). The ``tests/test_*.py`` files start processes: real
horovodrun, mpirun and Slurm jobs, and fresh interpreters; the fixtures below share their slowest
jobs between files.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent / "workers"))  # models.py and the checks the tests name

import slurm_jobs
from hvd_launch import LIGHTNING_PACKAGES, TWO_NODES, horovodrun_path, run_job, run_on_mpi_nodes

from hvd_plugins.testing.launch import mpi_launch_problem
from hvd_plugins.testing.netns_cluster import ClusterUnavailable, NamespaceCluster

UNIT_TESTS = Path(__file__).resolve().parent / "unit"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/unit/ is in the in-process tier: marked ``unit``, and never ``multiprocess``."""
    for item in items:
        if item.path.is_relative_to(UNIT_TESTS):
            if item.get_closest_marker("multiprocess") is not None:
                raise pytest.UsageError(f"{item.nodeid} is marked multiprocess; such tests belong in tests/test_*.py")
            item.add_marker(pytest.mark.unit)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Slurm's requeue jobs spend minutes asleep: start them now, beside the rest of the suite."""
    if any(item.nodeid.startswith("tests/test_slurm.py::test_time_limit") for item in session.items):
        slurm_jobs.start_requeue_jobs()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    slurm_jobs.stop()


def pytest_configure(config: pytest.Config) -> None:
    if shutil.which(horovodrun_path()) is None and not Path(horovodrun_path()).exists():
        raise pytest.UsageError("horovodrun is not installed; run `bash ci/test.sh`, which builds it")


_two_worker_reports: dict[tuple[str, str], dict[int, dict]] = {}

TWO_WORKER_VARIANTS = [(package, "gloo") for package in LIGHTNING_PACKAGES] + [("lightning.pytorch", "mpi")]
"""The shared job runs with each Lightning package over Gloo, and over MPI (mpirun under horovodrun --mpi)."""


SHARED_JOB_ENV = {"HOROVOD_IDLE_CYCLE_TIME": "2000", "HOROVOD_TIMELINE": "DYNAMIC"}
"""Idle rounds 2 s apart: a collective whose enqueue failed to wake Horovod's loop would stall every check
of the shared job by up to 2 s. The timeline starts dynamic, as the idle-loop check records one."""


def skip_without_mpi() -> None:
    """Skip (with the reason printed) where horovodrun --mpi cannot run."""
    problem = mpi_launch_problem()
    if problem:
        print(f"skipping the MPI variant: {problem}")
        pytest.skip(f"needs horovodrun --mpi: {problem}")


def two_worker_reports(
    lightning: str, tmp_path_factory: pytest.TempPathFactory, controller: str = "gloo"
) -> dict[int, dict]:
    """Every rank's report of the one two-worker, one-node job of checks (tests/workers/strategy_features.py),
    with the worker written for ``lightning`` ("lightning.pytorch" or "pytorch_lightning") and Horovod's
    ``controller`` ("gloo" or "mpi"); run once per variant.

    Shared by the Lightning-feature, fault and Adasum tests: one launch instead of one per file. Each
    check is recorded on its own, under its function's name, so a failing check fails only the tests
    that read it (``_common.report_of(report, check_function)``).
    """
    key = (lightning, controller)
    if key not in _two_worker_reports:
        out = tmp_path_factory.mktemp(f"two_worker_checks_{lightning.replace('.', '_')}_{controller}")
        adasum = ("--adasum",) if controller == "mpi" else ()  # Adasum needs MPI; its checks share this launch
        job = run_job(
            "strategy_features.py", *adasum, np=2, out_dir=out, timeout=900, lightning=lightning,
            controller=controller, env=SHARED_JOB_ENV,
        ).check()  # fmt: skip
        assert sorted(job.results) == [0, 1], job.output[-3000:]
        _two_worker_reports[key] = job.results
    return _two_worker_reports[key]


_two_node_reports: dict[str, dict[int, dict]] = {}


def two_node_reports(
    launch: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[int, dict]:
    """Every rank's report of the one job on two nodes of two workers (tests/workers/hierarchical_checks.py),
    launched by ``launch``: "gloo" (horovodrun on two emulated nodes) or "mpi" (mpirun on two network
    namespaces); run once per launch.

    The two-level allreduce checks, the node-aware strategy checks and DASO's two-by-two checks share
    it (Adasum's too, under MPI): four workers take long to start on a small host.
    """
    if launch not in _two_node_reports:
        out = tmp_path_factory.mktemp(f"two_nodes_{launch}")
        adasum = ("--adasum",) if launch == "mpi" else ()  # Adasum needs MPI; its checks share this launch
        if launch == "mpi":
            job = run_on_mpi_nodes(
                request.getfixturevalue("mpi_nodes"), "hierarchical_checks.py", *adasum, out_dir=out, timeout=900
            )
        else:
            job = run_job("hierarchical_checks.py", np=4, hosts=TWO_NODES, out_dir=out, timeout=900)
        job.check()
        assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
        job.results[0]["route_lines"] = [line for line in job.output.splitlines() if "training steps took" in line]
        _two_node_reports[launch] = job.results
    return _two_node_reports[launch]


@pytest.fixture(scope="session", params=TWO_WORKER_VARIANTS, ids=lambda variant: "-".join(variant))
def two_worker_checks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The shared two-worker job's reports, once with each Lightning package and once over MPI."""
    lightning, controller = request.param
    if controller == "mpi":
        skip_without_mpi()
    return two_worker_reports(lightning, tmp_path_factory, controller)


@pytest.fixture(scope="session")
def mpi_nodes():
    """Two nodes for MPI: network namespaces with their own host names, reached by mpirun through an rsh agent."""
    skip_without_mpi()
    cluster = NamespaceCluster(nodes=2, shaping="")
    try:
        cluster.create()
        cluster.check_reachable(sys.executable)
    except ClusterUnavailable as error:
        cluster.teardown()
        print(f"skipping the MPI-node jobs: {error}")
        pytest.skip(f"network namespaces for two MPI nodes are unavailable: {error}")
    yield cluster
    cluster.teardown()
