"""Fabric(strategy="horovod") in plain loops: every check of tests/workers/fabric_checks.py against one process
with the whole batch, under horovodrun (Gloo; two nodes of one worker), with ``lightning_fabric``, and over MPI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _common import Check, report_of
from conftest import skip_without_mpi
from fabric_checks import (
    check_a_layer_unfrozen_while_training_is_averaged,
    check_accumulating_without_no_backward_sync_equals_the_large_batch,
    check_clipping_sees_averaged_gradients,
    check_collectives,
    check_compiled_module_trains_like_eager,
    check_daso_is_refused_at_construction,
    check_hierarchical_accumulation_equals_the_large_batch,
    check_mixed_precision_trains_alike_on_every_rank,
    check_no_backward_sync_accumulates_with_one_allreduce_per_step,
    check_save_once_load_everywhere_and_resume_identically,
    check_schedulers_built_before_setup_set_every_ranks_rates,
    check_setup_broadcasts_rank_zeros_state,
    check_setup_dataloaders_split_the_data,
    check_steps_equal_one_process_on_the_global_batch,
    check_two_optimizers_set_up_apart_keep_distinct_names,
)
from hvd_launch import run_job

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.fabric",
    "hvd_plugins.fabric.lightning_internals",
    "hvd_plugins.fabric.strategies.horovod",
    "hvd_plugins.fabric.strategies.registry",
    "hvd_plugins.fabric.strategies.shared",
    "hvd_plugins.core.comm.collectives",
    "hvd_plugins.core.sync.hierarchical.mode",
    "hvd_plugins.core.training_state",
)

pytestmark = pytest.mark.multiprocess

TWO_BY_ONE = "localhost:1,127.0.0.1:1"
VARIANTS = {
    "lightning.fabric-gloo-two-nodes": ("lightning.pytorch", "gloo", TWO_BY_ONE),
    "lightning_fabric-gloo": ("pytorch_lightning", "gloo", None),
    "lightning.fabric-mpi": ("lightning.pytorch", "mpi", None),
}
EXACT = 1e-12  # float64 model and data: averaging over workers equals one process up to rounding


@pytest.fixture(scope="module", params=list(VARIANTS))
def checks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    lightning, controller, hosts = VARIANTS[request.param]
    if controller == "mpi":
        skip_without_mpi()
    out = tmp_path_factory.mktemp("fabric")
    job = run_job(
        "fabric_checks.py", np=2, hosts=hosts, out_dir=out, timeout=600, lightning=lightning, controller=controller
    )
    job.check()
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    return job.results


def value(checks: dict[int, dict], check: Check, rank: int) -> Any:
    return report_of(checks[rank], check)


def test_setup_gives_every_worker_rank_zeros_parameters_and_buffers(checks: dict[int, dict]) -> None:
    for rank in (0, 1):
        result = value(checks, check_setup_broadcasts_rank_zeros_state, rank)
        assert result == {"same": True, "weight": 1.0, "running_mean": 5.0}


def test_backward_and_step_average_like_one_process_with_the_whole_batch(checks: dict[int, dict]) -> None:
    for rank in (0, 1):
        result = value(checks, check_steps_equal_one_process_on_the_global_batch, rank)
        assert result["max_diff"] < EXACT and result["same"]
        assert result["allreduces_per_step"] == 1  # the model's 4 gradients make one bucket


def test_no_backward_sync_accumulates_with_one_allreduce_per_step_and_equals_the_large_batch(
    checks: dict[int, dict],
) -> None:
    for rank in (0, 1):
        result = value(checks, check_no_backward_sync_accumulates_with_one_allreduce_per_step, rank)
        assert result["max_diff"] < EXACT and result["same"]
        assert result["allreduces_per_step"] == 1  # one per bucket, not one per micro-batch
        assert value(checks, check_hierarchical_accumulation_equals_the_large_batch, rank)["max_diff"] < EXACT


def test_accumulating_without_no_backward_sync_allreduces_every_backward_and_equals_the_large_batch(
    checks: dict[int, dict],
) -> None:
    for rank in (0, 1):
        for op, result in value(
            checks, check_accumulating_without_no_backward_sync_equals_the_large_batch, rank
        ).items():
            assert result["max_diff"] < EXACT and result["same"], (op, result)
            assert result["allreduces_per_step"] == 3, (op, result)  # the one bucket, every micro-batch


def test_clip_gradients_sees_the_averaged_gradients(checks: dict[int, dict]) -> None:
    for rank in (0, 1):
        result = value(checks, check_clipping_sees_averaged_gradients, rank)
        assert result["norms"] == pytest.approx(result["expected_norms"], rel=1e-12)
        assert min(result["expected_norms"]) > 0.05  # clipping changed every step
        assert result["max_diff"] < EXACT


def test_optimizers_set_up_in_separate_calls_get_distinct_allreduce_names(checks: dict[int, dict]) -> None:
    for rank in (0, 1):
        result = value(checks, check_two_optimizers_set_up_apart_keep_distinct_names, rank)
        assert result["same"] and len(set(result["names"])) == 8
        assert {name.split(".")[0] for name in result["names"]} == {"opt0", "opt1"}


def test_collectives_and_dataloaders(checks: dict[int, dict]) -> None:
    for rank in (0, 1):
        result = value(checks, check_collectives, rank)
        assert result == {
            "mean": 1.5,
            "sum": 3.0,
            "max": 2.0,
            "in_place": [[3.0], True],  # the input holds the sum, as torch.distributed.all_reduce leaves it
            "integer_mean": ["torch.float64", [1.5], [rank + 1]],  # cannot go back into integers: left as it was
            "gathered": [1.0, 2.0],
            # d/dx of every rank's sum of squares of the gathered tensors: 2 * x * 2 ranks, as DDP's gather
            "gathered_gradients": [[4.0 * (rank + 1), 4.0], [2.0, 2.0]],
            "broadcast": {"from": 1},
        }
        assert value(checks, check_setup_dataloaders_split_the_data, rank) == {"counts": [20, 20], "union": True}


def test_save_writes_once_and_load_continues_identically_on_every_rank(checks: dict[int, dict], tmp_path: Path) -> None:
    for rank in (0, 1):
        result = value(checks, check_save_once_load_everywhere_and_resume_identically, rank)
        assert result["remainder"] == {"step": 3}  # what was not a module or optimizer comes back
        assert result["resume_diff"] == 0.0 and result["same"]
        assert result["leftovers"] == []  # the atomic write left no temporary file


def test_mixed_precision_trains_identically_on_every_rank(checks: dict[int, dict]) -> None:
    for rank in (0, 1):
        result = value(checks, check_mixed_precision_trains_alike_on_every_rank, rank)
        assert all(entry["same"] for entry in result.values()), result
        if "16-mixed+GradScaler" in result:  # torch 2.3+ has a CPU GradScaler
            assert result["16-mixed+GradScaler"]["scaler"] == "GradScaler"


def test_a_layer_unfrozen_while_training_is_averaged_like_the_rest(checks: dict[int, dict]) -> None:
    for rank in (0, 1):
        result = value(checks, check_a_layer_unfrozen_while_training_is_averaged, rank)
        # one bucket a step, built again with the unfrozen layer before its first backward
        assert result == {"same": True, "trained": True, "allreduces_per_step": [1.0, 1.0]}


def test_schedulers_built_before_setup_set_every_ranks_rates(checks: dict[int, dict]) -> None:
    """Horovod's wrapper is a new optimizer; a scheduler built on the one it wrapped must still reach it."""
    expected = {"supported": True, "rates": [0.05, 0.025, 0.0125, 0.00625], "rates_everywhere": True, "same": True,
                "warnings": []}  # fmt: skip
    for rank in (0, 1):
        result = value(checks, check_schedulers_built_before_setup_set_every_ranks_rates, rank)
        assert result["kept_by_the_loop"] == expected
        assert result["handed_to_setup"] in (expected, {"supported": False})  # Fabric 2.4 added scheduler=


def test_daso_is_refused_with_the_reason(checks: dict[int, dict]) -> None:
    message = value(checks, check_daso_is_refused_at_construction, 0)
    assert message.startswith("sync='daso' is not available with Fabric")


def test_compiled_module_trains_like_eager_with_graphs_cut_and_plain_names(checks: dict[int, dict]) -> None:
    """``fabric.setup(torch.compile(model))``: Fabric compiles the module again after the strategy set it up."""
    for rank in (0, 1):
        for name, case in value(checks, check_compiled_module_trains_like_eager, rank).items():
            assert case["vs_eager"] == 0.0 and case["same"], (name, case)  # aot_eager: eager's kernels
            assert case["pieces"] == 2 and case["graph_breaks"] == 0, (name, case)
            assert case["compiled_names"] == [] and case["names"], (name, case)
