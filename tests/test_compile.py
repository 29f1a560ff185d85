"""``torch.compile`` under HorovodStrategy: real two-worker horovodrun jobs, both Lightning packages and MPI.

The checks run inside the shared two-worker job (tests/workers/compile_checks.py, in strategy_features.py's
job); Fabric's compiled module is checked in the Fabric job (tests/test_fabric.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from _common import report_of
from compile_checks import (
    MODES,
    check_compiled_fit_equals_eager,
    check_compiled_graphs_and_overlap,
    check_compiled_loops_and_checkpoint,
    check_compiled_mixed_precision,
)

COVERS = ("hvd_plugins.core.compiled_graphs",)

pytestmark = pytest.mark.multiprocess

INDUCTOR_TOLERANCE = 1e-4
"""Inductor against eager after 8 AdamW steps (lr 1e-3, largest parameter 0.36): its fused kernels sum in
another order, and Adam's normalized update carries each rounding into the parameters (9.6e-6 measured)."""


@pytest.fixture
def compiled(two_worker_checks: dict[int, dict]) -> dict[int, dict]:
    return two_worker_checks


def both(reports: dict[int, dict], check: Any) -> list[Any]:
    return [report_of(reports[rank], check) for rank in (0, 1)]


def test_compiled_fit_equals_eager_in_every_sync_and_shard_mode(compiled: dict[int, dict]) -> None:
    for result in both(compiled, check_compiled_fit_equals_eager):
        assert sorted(result) == sorted(MODES)
        for name, case in result.items():
            # aot_eager runs the eager kernels: the compiled fit must land exactly where eager training does
            assert case["vs_eager"] == 0.0, (name, case)
            assert case["ranks_identical"] and case["steps"] == 8, (name, case)
            # 1 MiB buckets cut the 1.9 MB model's graph in two; the strategy adds no graph break
            assert case["pieces"] == 2 and case["graph_breaks"] == 0, (name, case)


def test_compiled_bf16_mixed_equals_eager(compiled: dict[int, dict]) -> None:
    for result in both(compiled, check_compiled_mixed_precision):
        for name, case in result.items():
            assert case["vs_eager"] == 0.0 and case["ranks_identical"], (name, case)


def test_inductor_trains_like_eager_in_one_graph_cut_at_buckets(compiled: dict[int, dict]) -> None:
    for result in both(compiled, check_compiled_graphs_and_overlap):
        assert result["vs_eager"] < INDUCTOR_TOLERANCE, result
        assert result["ranks_identical"]
        assert result["graph_breaks"] == {}
        # the training step, and once more when a probe asks for the input's gradient: each cut in two
        assert result["unique_graphs"] == 2 and result["pieces"] == 4
        # the last piece's parameters reached the sync before backward computed the input's gradient
        assert 0 < result["ready_before_input_gradient"] < result["parameters"]


def test_compiled_sync_batchnorm_adds_no_graph_break(compiled: dict[int, dict]) -> None:
    for result in both(compiled, check_compiled_graphs_and_overlap):
        case = result["sync_batchnorm"]
        assert case["graph_breaks"] == {} and case["unique_graphs"] == 1, case
        assert case["vs_eager"] == 0.0 and case["ranks_identical"], case


def test_compiled_model_validates_tests_predicts_and_checkpoints_uncompiled_names(compiled: dict[int, dict]) -> None:
    for result in both(compiled, check_compiled_loops_and_checkpoint):
        for stage, (compiled_loss, eager_loss) in result["losses"].items():
            assert compiled_loss == eager_loss, stage
        assert result["predictions_diff"] == 0.0
        assert result["compiled_names"] == [] and result["keys"] == 10
        assert result["loaded_equal"]  # a plain, uncompiled module loads it strictly
        assert result["resumed_steps"] == 8  # a fit of an uncompiled model resumes from it: 4 more steps
