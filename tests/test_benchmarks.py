"""The benchmark scripts run end to end in their --smoke mode and print sane numbers.

These check that each benchmark works and that what it prints is self-consistent (positive
rates, byte counts equal to the analytic expectation, tables present), never how fast anything is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
SKIP_EXIT_CODE = 77  # emulated_cluster.py: namespaces cannot be made here

pytestmark = pytest.mark.multiprocess


def run_benchmark(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_smoke(script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_benchmark(script, "--smoke", timeout=timeout)


def skip_without_namespaces(result: subprocess.CompletedProcess[str]) -> None:
    """The emulated-cluster scripts exit with SKIP_EXIT_CODE where namespaces cannot be made."""
    if result.returncode == SKIP_EXIT_CODE:
        pytest.skip(result.stdout.strip().splitlines()[-1])


def assert_no_namespaces_left() -> None:
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "-node0" not in leftovers and "-node1" not in leftovers, f"namespaces left behind: {leftovers}"


def test_overhead_smoke_prints_positive_rates_and_verdicts() -> None:
    result = run_smoke("overhead.py", timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rates = dict(re.findall(r"(horovod_loop|horovod_strategy|lightning_ddp)=([0-9.]+)", result.stdout))
    assert set(rates) == {"horovod_loop", "horovod_strategy", "lightning_ddp"}, result.stdout
    assert all(float(rate) > 0 for rate in rates.values()), rates
    ratio_lines = [line for line in result.stdout.splitlines() if line.lstrip().startswith(("b/a", "b/c"))]
    assert len(ratio_lines) == 2, result.stdout
    for line in ratio_lines:
        measured = re.search(r"\s([0-9.]+)\s+>=", line)
        assert measured is not None and float(measured.group(1)) > 0, line
        assert line.rstrip().endswith(("met", "not met")), line


def test_comm_volume_smoke_counts_equal_the_analytic_expectation() -> None:
    result = run_smoke("comm_volume.py", timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all measured counts equal the analytic expectation" in result.stdout, result.stdout
    rows = {tuple(line.split()[:2]): line for line in result.stdout.splitlines() if line.split()[:1] in (
        ["allreduce"], ["hierarchical"], ["daso"])}  # fmt: skip
    for sync in ("allreduce", "hierarchical", "daso"):
        for compression in ("none", "fp16"):
            assert rows[(sync, compression)].rstrip().endswith("yes (all ranks)"), rows
        cross = {c: int(rows[(sync, c)].split()[4].replace(",", "")) for c in ("none", "fp16")}
        assert cross["none"] > 0 and cross["fp16"] * 2 == cross["none"], (sync, cross)


def test_emulated_cluster_smoke_sweeps_both_topologies_and_writes_records(tmp_path: Path) -> None:
    result = run_benchmark("emulated_cluster.py", "--smoke", "--results-dir", str(tmp_path), timeout=900)
    skip_without_namespaces(result)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = {tuple(line.split()[1:4]): line.split() for line in result.stdout.splitlines() if line.startswith("smoke ")}
    expected = {("2x1", "50", "allreduce/none"), ("2x1", "50", "daso/fp16"), ("2x2", "50", "allreduce/none"),
                ("2x2", "50", "hierarchical/none"), ("2x2", "50", "daso/fp16")}  # fmt: skip
    assert set(table) == expected, result.stdout  # no two-level allreduce where a node has one worker
    for key, cells in table.items():
        step_ms, cross_kb, accuracy = float(cells[6]), float(cells[7]), float(cells[8])
        assert step_ms > 0 and cross_kb > 0 and 0 <= accuracy <= 100, cells
        assert (cells[9] == "(baseline)") == (key[2] == "allreduce/none"), cells
    records = json.loads((tmp_path / "emulated_sweep.json").read_text())["runs"]
    assert len(records) == len(expected)
    for run in records:
        assert run["steps"] >= 2 and run["mean_step_s"] > 0, run
        phases = set(run["phases"])
        if run["mode"].startswith("daso"):  # the smoke run may stop at its target before the cooldown epoch
            assert "warmup" in phases and phases <= {"warmup", "cycling", "cooldown"}, phases
        else:
            assert phases == {"sync"}, phases
        assert run["phases"].get("sync", run["phases"].get("warmup"))["cross_node_bytes_per_step"] > 0, run
    for name in ("emulated_sweep.txt", "emulated_sweep.csv", "emulated_sweep.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert_no_namespaces_left()


def test_transport_smoke_runs_the_packages_and_a_process_set_transport_and_checks_the_sums() -> None:
    result = run_smoke("transport.py", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.split()[:3:2] == ["2x1", "1k"]}
    assert set(rows) == {"static", "alltoall"}, result.stdout
    for transport, line in rows.items():
        assert re.search(r"\syes\s+0/1$", line.rstrip()), (transport, line)  # two-level sum correct, no failure
        global_ms, two_level_ms = re.findall(r"\s([0-9.]+) \(", line)[0], re.findall(r"\s([0-9.]+) \(", line)[-1]
        assert float(global_ms) > 0 and float(two_level_ms) > 0, line


def test_duplex_times_every_collective_on_two_emulated_nodes() -> None:
    args = ("--link-mbit", "unshaped", "--mb", "0.2", "--trials", "2", "--no-save")
    result = run_benchmark("duplex.py", *args, timeout=300)
    skip_without_namespaces(result)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split()[1]: line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["unshaped"]}
    assert set(rows) == {"flat", "exchange", "relay", "one_way", "two_level"}, result.stdout
    for cells in rows.values():
        assert float(cells[2]) > 0 and float(cells[4]) > 0, cells
    assert_no_namespaces_left()
