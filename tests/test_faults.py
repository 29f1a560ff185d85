"""Failures end the whole job with a clear message; bad configuration fails the same way on every rank."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
from _common import Check, reports_of
from conftest import skip_without_mpi
from faults_checks import (
    check_with_grad_scaler,
    compression_differs,
    daso_settings_differ,
    devices_disagree_with_the_job,
    grad_scaler_skips_everywhere,
    inf_under_bf16,
    nan_stops_training,
    nan_without_check,
    num_nodes_disagree_with_the_job,
    op_differs,
    optimizer_count_differs,
    parameter_shapes_differ,
    still_in_step,
)
from hvd_launch import TWO_NODES, JobResult, run_job

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins",
    "hvd_plugins.core.backend.agreement",
    "hvd_plugins.core.backend.stall",
    "hvd_plugins.core.faults.fingerprints",
    "hvd_plugins.core.faults.finite",
    "hvd_plugins.core.faults.report",
    "hvd_plugins.core.faults.watchdog",
    "hvd_plugins.core.sync.guards",
    "hvd_plugins.fabric.plugins.io.atomic",
)


# ---------------------------------------------------------------------------- failed workers
def assert_no_worker_survives(out: Path, ranks: int) -> None:
    survivors = []
    for rank in range(ranks):
        pid = int((out / f"pid{rank}").read_text())
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE and "faults_" in " ".join(process.cmdline()):
                survivors.append((rank, pid))
        except psutil.NoSuchProcess:
            continue
    assert not survivors, f"workers still running after the job ended: {survivors}"


def assert_failed(job: JobResult) -> None:
    assert job.returncode != 0, job.output[-3000:]
    assert "finished training" not in job.output


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "np", "hosts", "victim", "controller"),
    [
        ("raise", 2, None, 1, "gloo"),
        ("kill", 2, None, 1, "gloo"),
        ("kill", 4, TWO_NODES, 3, "gloo"),
        ("raise", 2, None, 1, "mpi"),
        ("kill", 2, None, 1, "mpi"),
    ],
    ids=["raise-1-of-2", "kill-1-of-2", "kill-1-of-4", "mpi-raise-1-of-2", "mpi-kill-1-of-2"],
)
def test_a_failed_worker_ends_the_whole_job(
    tmp_path: Path, case: str, np: int, hosts: str | None, victim: int, controller: str
) -> None:
    if controller == "mpi":
        skip_without_mpi()
    args = ("--case", case, "--victim", str(victim))
    job = run_job("faults_crash.py", *args, np=np, hosts=hosts, out_dir=tmp_path, controller=controller)
    assert_failed(job)
    if controller == "gloo" and case == "kill":
        assert f"Process {victim} exit with status code 137" in job.output  # horovodrun names the rank
    elif controller == "gloo":
        # horovodrun names the first process to exit: a raising victim races the others, which stop as soon as its
        # Horovod goes; the package's own report, checked below, names the victim
        first = r"Process \d+ exit with status code 1\b|Process name: \d+\s+Exit code: 1\b"
        assert re.search(first, job.output), job.output[-3000:]
    else:  # mpirun names the rank that ended the job
        assert "mpirun" in job.output and (f"rank {victim}" in job.output or f"process rank {victim}" in job.output)
    if case == "raise":
        assert f"hvd_plugins: rank {victim} of {np}" in job.output
        assert "RuntimeError: injected failure" in job.output
    assert_no_worker_survives(tmp_path, np)


@pytest.fixture(scope="module")
def stalled_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[JobResult, Path]]:
    """Both stall jobs, run side by side: each spends most of its time waiting out the stall.

    ``explicit``: ``stall_timeout_seconds=3``. ``default``: no argument, and horovodrun's
    ``--stall-check-shutdown-time-seconds 3`` exported to every worker. Without the bound each
    job would hang until run_job's timeout failed the test.
    """
    jobs = {
        "explicit": (("--stall-timeout", "3"), None),
        "default": ((), {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}),
    }

    def run(name: str) -> tuple[JobResult, Path]:
        args, env = jobs[name]
        out = tmp_path_factory.mktemp(f"stall_{name}")
        return run_job("faults_crash.py", "--case", "stall", *args, out_dir=out, timeout=240, env=env), out

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        return dict(zip(jobs, pool.map(run, jobs), strict=True))


@pytest.mark.multiprocess
def test_ctrl_c_interrupts_a_rank_waiting_in_a_collective(tmp_path: Path) -> None:
    """The build's hvd.synchronize sleeps, waking to let Python handle signals (a spinning wait never did)."""
    job = run_job("interrupt_wait.py", np=2, out_dir=tmp_path, timeout=120).check()
    report = job.results[1]
    assert report["outcome"] == "interrupted", job.output[-3000:]
    assert report["seconds"] < 3, report  # SIGINT came after 1 s; the wait wakes every 100 ms


@pytest.mark.multiprocess
def test_a_rank_that_skips_a_collective_ends_the_job_after_the_stall_timeout(
    stalled_jobs: dict[str, tuple[JobResult, Path]],
) -> None:
    job, out = stalled_jobs["explicit"]
    assert_failed(job)
    assert "hvd_plugins: rank 0 of 2" in job.output and "stall_timeout_seconds=3" in job.output
    assert "Process 0 exit with status code 75" in job.output
    assert_no_worker_survives(out, 2)


@pytest.mark.multiprocess
def test_by_default_a_stalled_rank_ends_the_job_after_horovodruns_stall_shutdown_time(
    stalled_jobs: dict[str, tuple[JobResult, Path]],
) -> None:
    """No stall_timeout_seconds given: the default honours what horovodrun's
    --stall-check-shutdown-time-seconds exports to every worker, instead of waiting forever."""
    job, out = stalled_jobs["default"]
    assert_failed(job)
    assert "stall_timeout_seconds=3" in job.output and "Process 0 exit with status code 75" in job.output
    assert_no_worker_survives(out, 2)


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.multiprocess
def test_a_job_killed_while_saving_resumes_from_the_last_complete_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # One job: an uninterrupted reference run, then the run that is killed while saving.
    crash = run_job(
        "faults_checkpoint.py", "--phase", "reference,crash", "--ckpt-dir", str(ckpt), out_dir=tmp_path / "crash"
    )
    assert crash.returncode != 0 and "Process 0 exit with status code 137" in crash.output
    assert_no_worker_survives(tmp_path / "crash", 2)
    assert sorted(crash.results) == [0, 1] and all(sorted(r) == ["reference"] for r in crash.results.values())
    finals = sorted(path.name for path in ckpt.iterdir() if not path.name.startswith("."))
    assert finals == ["epoch=0.ckpt", "epoch=1.ckpt"], finals  # no file with the final name for epoch 2
    assert all(path.name.endswith(".tmp") for path in ckpt.iterdir() if path.name.startswith("."))
    assert torch.load(ckpt / "epoch=1.ckpt", weights_only=False)["epoch"] == 1
    resumed = run_job(
        "faults_checkpoint.py",
        "--phase",
        "resume",
        "--ckpt-dir",
        str(ckpt),
        "--resume-from",
        str(ckpt / "epoch=1.ckpt"),
        out_dir=tmp_path / "resume",
    ).check()
    resumed_runs = {rank: result["resume"] for rank, result in resumed.results.items()}
    assert len({result["digest"] for result in resumed_runs.values()}) == 1  # identical weights on all ranks
    expected = crash.results[0]["reference"]
    for rank, result in resumed_runs.items():
        assert sorted(result["epoch_losses"]) == ["2", "3"], rank
        for epoch, loss in result["epoch_losses"].items():
            assert loss == pytest.approx(expected["epoch_losses"][epoch], rel=1e-5), (rank, epoch)
        assert result["weights"] == pytest.approx(expected["weights"], rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------- configuration and numbers
@pytest.fixture
def checks(two_worker_checks: dict[int, dict]) -> dict[int, dict]:
    """The shared two-worker job's reports (see conftest.py), which include tests/workers/faults_checks.py's."""
    return two_worker_checks


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        pytest.param(compression_differs, "rank 1 has compression='fp16' but rank 0 has 'none'", id="compression"),
        pytest.param(op_differs, "rank 1 has op='sum' but rank 0 has 'average'", id="op"),
        pytest.param(parameter_shapes_differ, "rank 1 has parameters=", id="parameter_shapes"),
        pytest.param(optimizer_count_differs, "rank 1 has optimizers=", id="optimizer_count"),
        pytest.param(daso_settings_differ, "rank 1 has daso=", id="daso_knobs"),
        pytest.param(devices_disagree_with_the_job, "Trainer(devices=3) disagrees with the Horovod job", id="devices"),
        pytest.param(
            num_nodes_disagree_with_the_job, "Trainer(num_nodes=3) disagrees with the Horovod job", id="num_nodes"
        ),
    ],
)
def test_ranks_that_disagree_fail_at_setup_with_the_same_error(checks: dict[int, dict], case: Check, expected: str):
    errors = reports_of(checks, case)
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("ValueError") and expected in errors[0], errors[0]


@pytest.mark.multiprocess
def test_nan_gradients_stop_every_rank_naming_step_and_rank(checks: dict[int, dict]) -> None:
    stopped = reports_of(checks, nan_stops_training)
    assert stopped[0] == stopped[1]
    assert stopped[0]["error"].startswith("NonFiniteGradientError: Non-finite gradients at epoch 0, global step 3")
    assert "on rank(s) [1]" in stopped[0]["error"]
    assert stopped[0]["weights_finite"]
    assert reports_of(checks, nan_without_check) == [{"weights_finite": False}] * 2  # what the check prevents
    bf16 = reports_of(checks, inf_under_bf16)
    assert bf16[0] == bf16[1] and "on rank(s) [1]" in bf16[0]


@pytest.mark.multiprocess
def test_grad_scaler_skips_the_same_step_on_every_rank(checks: dict[int, dict]) -> None:
    refused = reports_of(checks, check_with_grad_scaler)
    if refused[0].startswith("skipped: "):
        pytest.skip(refused[0])
    assert refused[0] == refused[1] and refused[0].startswith("ValueError: check_finite_gradients=True cannot")
    scaled = reports_of(checks, grad_scaler_skips_everywhere)
    assert scaled[0] == scaled[1] and scaled[0]["finite"]
    assert scaled[0]["scale"] < 65536.0  # the inf on rank 1 made every rank back off and skip


@pytest.mark.multiprocess
def test_ranks_stay_in_step_after_every_failed_case(checks: dict[int, dict]) -> None:
    digests = reports_of(checks, still_in_step)
    assert digests[0] == digests[1]


@pytest.fixture(scope="module")
def unequal_nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """One job of 3 workers on nodes of 2 and 1 that tries every node-aware sync mode in turn."""
    out = tmp_path_factory.mktemp("unequal_nodes")
    job = run_job("faults_launch.py", np=3, hosts="localhost:2,127.0.0.1:1", out_dir=out).check()
    assert sorted(job.results) == [0, 1, 2], job.output[-3000:]
    return job.results


@pytest.mark.multiprocess
@pytest.mark.parametrize("sync", ["hierarchical", "daso"])
def test_node_aware_sync_refuses_unequal_nodes(unequal_nodes: dict[int, dict], sync: str) -> None:
    errors = [unequal_nodes[rank][sync] for rank in range(3)]
    assert len(set(errors)) == 1, errors
    assert "needs the same number of workers on every node" in errors[0] and "{0: 2, 1: 1}" in errors[0]
