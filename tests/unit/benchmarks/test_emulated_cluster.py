"""benchmarks/emulated_cluster.py without its jobs: the grid it sweeps and the run it reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `benchmarks` is a package of the checkout, not of the installed project

from benchmarks import emulated_cluster  # noqa: E402


def test_the_two_level_allreduce_runs_only_where_a_node_has_two_workers() -> None:
    grid = emulated_cluster.build_grid(emulated_cluster_args("--smoke", "--topology", "2x1,2x2"))
    by_topology = {topology.label: grid.modes_for(topology) for topology in grid.topologies}
    assert by_topology == {
        "2x1": ["allreduce/none", "daso/fp16"],
        "2x2": ["allreduce/none", "hierarchical/none", "daso/fp16"],
    }
    assert [t.label for t in emulated_cluster.build_grid(emulated_cluster_args("--smoke")).topologies] == ["2x1"]


def test_repeated_runs_report_the_median_run_and_keep_every_time() -> None:
    def attempt(seconds: float | None, reference: bool = False) -> dict[str, Any]:
        return {"time_to_target_s": seconds, "mean_step_s": 0.01, "reference": reference, "steps": 3}

    kept = emulated_cluster.median_attempt([attempt(9.0, reference=True), attempt(2.0), attempt(None)])
    assert kept["time_to_target_s"] == 9.0 and kept["reference"]  # a run that missed the target counts as slowest
    assert [a["time_to_target_s"] for a in kept["repeats"]] == [9.0, 2.0, None]
    assert emulated_cluster.median_attempt([attempt(3.0), attempt(1.0)])["time_to_target_s"] == 1.0  # lower median
    kept = emulated_cluster.median_attempt([attempt(1.0, reference=True), attempt(2.0), attempt(3.0)], failed=1)
    assert not kept["reference"] and kept["failed_repeats"] == 1  # the flag is the kept run's own
    grid = emulated_cluster.build_grid(emulated_cluster_args("--smoke", "--repeats", "3"))
    assert grid.repeats == 3 and grid.runs() == 6
    with pytest.raises(ValueError, match="--repeats 0 must be >= 1"):
        emulated_cluster.build_grid(emulated_cluster_args("--smoke", "--repeats", "0"))


def emulated_cluster_args(*argv: str) -> argparse.Namespace:
    return emulated_cluster.build_parser().parse_args(list(argv))
