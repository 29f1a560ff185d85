"""Monitoring callbacks: values checked against what the model and the launch imply."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from conftest import skip_without_mpi
from hvd_launch import LIGHTNING_PACKAGES, TWO_NODES, run_job, run_single

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.core.comm.counters",
    "hvd_plugins.core.tables",
    "hvd_plugins.pytorch.callbacks.comm_stats",
    "hvd_plugins.pytorch.callbacks.memory",
    "hvd_plugins.pytorch.callbacks.timeline",
)

WORKER = "callbacks_run.py"
PARAMETERS, BUCKETS = 8 * 4 + 4, 1  # the worker's Linear(8, 4): its two gradients make one bucket


def _csv_rows(out: Path) -> list[dict[str, str]]:
    with open(out / "logs" / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def _check_comm(result: dict, bytes_per_step: dict[str, int], calls_per_step: dict[str, int]) -> None:
    """Every worker's per-epoch counts equal (bytes or calls per optimizer step) x steps."""
    steps = result["steps_per_epoch"]
    assert len(result["comm"]) == len(steps) > 0
    for epoch, (traffic, epoch_steps) in enumerate(zip(result["comm"], steps, strict=True)):
        assert traffic["epoch"] == epoch and epoch_steps > 0
        for scope in ("node_local", "cross_node"):
            assert traffic["per_worker"][f"{scope}_bytes"] == [bytes_per_step[scope] * epoch_steps] * result["size"]
            assert traffic["per_worker"][f"{scope}_calls"] == [calls_per_step[scope] * epoch_steps] * result["size"]
        assert all(seconds >= 0 for seconds in traffic["per_worker"]["wait_seconds"])


def _check_memory(result: dict) -> None:
    assert [s["stage"] for s in result["memory"]] == ["train_start", "epoch_end", "epoch_end", "train_end"]
    for snapshot in result["memory"]:
        values = snapshot["per_worker"]["cpu_peak_rss_mb"]
        assert len(values) == result["size"] and all(v > 10 for v in values)


def _check_timeline_only_on_rank_zero(out: Path, size: int, collective: str = "ALLREDUCE") -> None:
    assert not any((out / f"timeline_rank{rank}.json").exists() for rank in range(1, size))
    text = (out / "timeline_rank0.json").read_text().strip()
    events = json.loads(text if text.endswith("]") else text.rstrip(",") + "]")  # Chrome accepts an open array
    names = {event.get("name") for event in events}
    assert f"NEGOTIATE_{collective}" in names and collective in names, sorted(n for n in names if n)[:20]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("lightning", "controller"),
    [(package, "gloo") for package in LIGHTNING_PACKAGES] + [("lightning.pytorch", "mpi")],
)
def test_callbacks_two_workers_fp16_with_accumulation(tmp_path: Path, lightning: str, controller: str) -> None:
    if controller == "mpi":
        skip_without_mpi()
    args = ("--compression", "fp16", "--accumulate", "2")
    job = run_job(WORKER, *args, np=2, out_dir=tmp_path, timeout=420, lightning=lightning, controller=controller)
    job.check()
    assert sorted(job.results) == [0, 1]
    for result in job.results.values():
        assert result["parameters"] == PARAMETERS
        # One node: the flat allreduce counts as node-local; fp16 sends 2 bytes per element.
        _check_comm(
            result, {"node_local": PARAMETERS * 2, "cross_node": 0}, {"node_local": BUCKETS, "cross_node": 0}
        )
        _check_memory(result)
        assert result["steps_per_epoch"] == [2, 2]  # 32 samples per worker, batches of 8, 2 per step
        assert result["timeline_recording_after_fit"] is False
    _check_timeline_only_on_rank_zero(tmp_path, 2)

    rows = _csv_rows(tmp_path)
    logged_bytes = [float(row["comm/node_local_bytes"]) for row in rows if row.get("comm/node_local_bytes")]
    assert logged_bytes == [PARAMETERS * 2 * 2] * 2
    assert any(row.get("memory/cpu_peak_rss_mb_max") for row in rows)
    tables = [line for line in job.output.splitlines() if "Peak memory over 2 worker(s)" in line]
    assert len(tables) == 1 and re.match(r"\[(\d+,)?0\]", tables[0]), tables  # horovodrun's [0], mpirun's [1,0]
    assert sum("Communication per worker" in line for line in job.output.splitlines()) == 1


@pytest.mark.multiprocess
def test_callbacks_two_nodes_hierarchical_split_local_and_cross(tmp_path: Path) -> None:
    job = run_job(
        WORKER, "--compression", "fp16", "--sync", "hierarchical", np=4, hosts=TWO_NODES, out_dir=tmp_path, timeout=420
    ).check()
    assert sorted(job.results) == [0, 1, 2, 3]
    shard = PARAMETERS // 2  # one bucket of 36 elements, split over the 2 workers of a node
    for result in job.results.values():
        assert result["cross_size"] == 2
        # Node-local legs in fp32 (reduce-scatter of the bucket, allgather of a shard); the
        # cross-node leg carries one fp16 shard.
        _check_comm(
            result,
            {"node_local": PARAMETERS * 4 + shard * 4, "cross_node": shard * 2},
            {"node_local": 2, "cross_node": 1},
        )
        _check_memory(result)
    _check_timeline_only_on_rank_zero(tmp_path, 4, collective="ALLTOALL")  # the two-level legs are alltoalls


@pytest.mark.multiprocess
def test_callbacks_in_one_plain_process(tmp_path: Path) -> None:
    job = run_single(WORKER, out_dir=tmp_path, timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    result = job.results[0]
    assert result["size"] == 1
    _check_comm(result, {"node_local": 0, "cross_node": 0}, {"node_local": 0, "cross_node": 0})
    _check_memory(result)
    assert "Peak memory over 1 worker(s)" in job.output
    # One worker runs no Horovod collectives: the timeline warns instead of writing an empty file.
    assert not (tmp_path / "timeline_rank0.json").exists()
