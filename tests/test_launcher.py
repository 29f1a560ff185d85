"""``python train.py`` with ``Trainer(devices=N)`` starts its workers itself, and matches horovodrun."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import skip_without_mpi
from doc_pages import snippet_marked
from hvd_launch import LIGHTNING_PACKAGES, run_job, run_mpirun, run_single

from hvd_plugins.testing.launch import run_bounded

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.core.backend.die_with_parent",
    "hvd_plugins.core.backend.launch_env",
    "hvd_plugins.core.backend.rendezvous",
    "hvd_plugins.core.backend.runner",
    "hvd_plugins.pytorch.strategies.launchers.horovod",
    "hvd_plugins.testing.horovodrun_unprobed",
    "hvd_plugins.testing.launch",
)


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a killed worker waits to be reaped by init)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _worker_pids(out: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(out.glob("pid*.txt"))]


def _all_gone(pids: list[int], within: float = 10.0) -> bool:
    """The processes end within ``within`` seconds (a killed process needs a moment to finish exiting)."""
    deadline = time.monotonic() + within
    while any(_running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.multiprocess
@pytest.mark.parametrize("lightning", LIGHTNING_PACKAGES)
def test_plain_python_with_two_devices_runs_two_workers_that_match_horovodrun(tmp_path: Path, lightning: str) -> None:
    plain = run_single("self_launch.py", out_dir=tmp_path / "plain", timeout=300, lightning=lightning)
    assert plain.returncode == 0, plain.output[-6000:]
    assert sorted(plain.results) == [0, 1], plain.output[-6000:]
    rank0, rank1 = plain.results[0], plain.results[1]
    for rank, result in plain.results.items():
        assert result["rank"] == rank
        assert result["world_size"] == result["horovod_size"] == result["local_size"] == 2
        assert result["global_step"] == 12  # 64 samples / 2 ranks / batches of 8, 3 epochs
    assert rank1["parent_pid"] == rank0["pid"]  # rank 1 was started by the process we started
    # the rendezvous server and Gloo listen while the job runs, on loopback only: nothing beyond this machine
    assert rank0["listening"] and all(address.startswith("127.") for address in rank0["listening"]), rank0
    assert rank0["parameters"] == rank1["parameters"]
    assert rank0["parameters"] != rank0["initial"]  # it trained

    launched = run_job(
        "self_launch.py", np=2, out_dir=tmp_path / "horovodrun", timeout=300, lightning=lightning
    ).check()
    assert sorted(launched.results) == [0, 1]
    for rank in (0, 1):
        assert launched.results[rank]["world_size"] == 2
        expected = torch.tensor([v for p in launched.results[rank]["parameters"] for v in p])
        got = torch.tensor([v for p in plain.results[rank]["parameters"] for v in p])
        assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got, expected)


@pytest.mark.multiprocess
@pytest.mark.mpi
def test_mpirun_starts_the_workers_itself_and_they_train_like_horovodrun(tmp_path: Path) -> None:
    """``mpirun -np 2 python train.py``: the MPI controller, no horovodrun, the same training."""
    skip_without_mpi()
    launched = run_mpirun("self_launch.py", np=2, out_dir=tmp_path / "mpirun", timeout=300).check("mpirun")
    reference = run_job("self_launch.py", np=2, out_dir=tmp_path / "horovodrun", timeout=300).check()
    assert sorted(launched.results) == [0, 1], launched.output[-3000:]
    for rank in (0, 1):
        result = launched.results[rank]
        assert result["rank"] == rank and result["world_size"] == result["horovod_size"] == 2
        assert result["global_step"] == 12 and result["parameters"] != result["initial"]
        expected = torch.tensor([v for p in reference.results[rank]["parameters"] for v in p])
        got = torch.tensor([v for p in result["parameters"] for v in p])
        assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got, expected)


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank_0", ["waits_in_a_collective", "sleeps"])
def test_a_failing_worker_ends_a_plain_python_launch_naming_its_rank(tmp_path: Path, rank_0: str) -> None:
    # a sleeping rank 0 learns of the failure from no collective: the launcher must end it
    sleep = ["--others-sleep"] if rank_0 == "sleeps" else []
    job = run_single("self_launch.py", "--fail-rank", "1", *sleep, out_dir=tmp_path, timeout=240)
    assert job.returncode == 1, job.output[-6000:]
    assert "hvd_plugins: worker rank 1 (pid" in job.output and "exited with status 1" in job.output, job.output[-6000:]
    assert job.seconds < 120
    assert job.results == {}  # no rank finished training
    assert len(_worker_pids(tmp_path)) == 2 and _all_gone(_worker_pids(tmp_path))


@pytest.mark.multiprocess
def test_killing_rank_0_takes_its_workers_with_it(tmp_path: Path) -> None:
    # rank 1 sleeps for 600 s outside any collective: without the parent-death signal it would outlive
    # rank 0 and keep the job's output open, and run_single would fail on its timeout
    job = run_single("self_launch.py", "--kill-rank", "0", "--others-sleep", out_dir=tmp_path, timeout=180)
    assert job.returncode == -9, job.output[-6000:]
    pids = _worker_pids(tmp_path)
    assert len(pids) == 2 and _all_gone(pids), job.output[-6000:]


@pytest.mark.multiprocess
def test_the_documented_script_runs_two_workers_with_plain_python(tmp_path: Path) -> None:
    snippet = snippet_marked("# needs its own script")  # docs/strategy.rst, "Without horovodrun"
    script = tmp_path / "train.py"
    script.write_text(snippet.source)
    job = run_bounded([sys.executable, str(script)], 300, cwd=tmp_path, drop_launcher_env=True)
    assert job.returncode == 0, job.output[-6000:]
    assert "rank 0 of 2 done" in job.output and "rank 1 of 2 done" in job.output, job.output[-6000:]
