"""Sharded training with Fabric on real workers: a plain loop trains as unsharded, holds 1/N of the optimizer
state, and saves and loads the whole state.

One job of four workers on two emulated nodes (tests/workers/sharded_fabric_checks.py) runs every check;
each compares ``shard="optimizer"`` and ``shard="gradients"`` with ``shard="none"`` from the same start.
"""

from __future__ import annotations

from typing import Any

import pytest
from _common import report_of
from hvd_launch import TWO_NODES, run_job
from sharded_fabric_checks import (
    CASES,
    INITIAL_SCALE,
    SHARDS,
    STEPS,
    check_a_grad_scaler_under_zero1_and_zero2,
    check_accumulating_without_no_backward_sync_is_refused,
    check_checkpoint_holds_the_whole_state_and_resumes,
    check_equal_to_unsharded,
    check_full_sharding,
    check_no_backward_sync_accumulation_equals_unsharded,
    check_torch_clipping_after_backward,
    check_zero3_in_users_orders,
    check_zero3_model_holds_its_shards,
)

COVERS = (
    "hvd_plugins.fabric.strategies.horovod",
    "hvd_plugins.fabric.strategies.shared",
    "hvd_plugins.core.sync.sharded.mode",
    "hvd_plugins.core.sync.sharded.optimizer",
    "hvd_plugins.core.sync.sharded.partition",
    "hvd_plugins.core.sync.sharded.unit_state",
)
"""The modules these real jobs exercise beyond their unit files."""

pytestmark = pytest.mark.multiprocess

WORKERS = 4
TOLERANCE = 1e-5
"""Of the largest parameter (or norm), in float32: the order of the sums is the only difference."""
STATE_TOLERANCE = 1e-6
"""Between the optimizer states two checkpoints hold (Adam's moments are far below 1)."""


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded_fabric")
    job = run_job("sharded_fabric_checks.py", np=WORKERS, hosts=TWO_NODES, out_dir=out, timeout=600)
    job.check()
    assert sorted(job.results) == list(range(WORKERS)), job.output[-3000:]
    return job.results


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_sharded_fabric_loop_with_clipping_trains_as_unsharded(four: dict[int, dict[str, Any]], case: str) -> None:
    clip = CASES[case][1]
    for rank in range(WORKERS):
        found = report_of(four[rank], check_equal_to_unsharded)[case]
        reference = found["none"]
        for stage, run in found.items():
            assert run["distributed_sampler"] and run["steps"] == STEPS, (stage, run)
            assert run["identical"], stage  # every worker holds the whole, same model
        for shard in SHARDS:
            assert found[shard]["difference"] <= TOLERANCE, (shard, found[shard]["difference"])
            assert found[shard]["norms"] == pytest.approx(reference["norms"], rel=TOLERANCE), shard
        assert found["unclipped"]["difference"] > 100 * TOLERANCE  # clipping changed the training
        if "max_norm" in clip:
            assert len(reference["norms"]) == STEPS
            assert sum(norm > clip["max_norm"] for norm in reference["norms"]) >= STEPS // 2, reference["norms"]
        else:
            assert reference["norms"] == []  # clipping by value returns no norm


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_fabric_worker_holds_a_quarter_of_the_optimizer_state(four: dict[int, dict[str, Any]], case: str) -> None:
    for rank in range(WORKERS):
        found = report_of(four[rank], check_equal_to_unsharded)[case]
        whole = found["none"]["state"]
        assert not whole["sharded"]
        assert whole["moment_bytes"] == 2 * 4 * whole["parameters"]  # two float32 moments a parameter
        assert whole["scalar_bytes"] == 4 * whole["parameter_tensors"]  # one float32 step count a parameter tensor
        for shard in SHARDS:
            share = found[shard]["state"]
            slices = share["slices"]
            assert share["sharded"] and slices >= 1 and share["parameters"] == whole["parameters"]
            padding = 2 * 4 * (WORKERS - 1) * slices  # at most N - 1 padded elements a bucket, two moments
            assert whole["moment_bytes"] / WORKERS <= share["moment_bytes"] <= whole["moment_bytes"] / WORKERS + padding
            assert share["scalar_bytes"] == 4 * slices  # one step count a slice
            assert share["state_bytes"] == share["moment_bytes"] + share["scalar_bytes"]  # it says what it holds
            total = whole["moment_bytes"] + whole["scalar_bytes"]
            assert share["state_bytes"] <= total / WORKERS + padding + 4 * slices, (shard, share, whole)
        small_buckets = CASES[case][2] < 1
        assert (found["gradients"]["state"]["slices"] > 1) == small_buckets


def test_no_backward_sync_accumulation_trains_as_unsharded(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORKERS):
        found = report_of(four[rank], check_no_backward_sync_accumulation_equals_unsharded)
        assert len(found["none"]["norms"]) == STEPS
        for shard in SHARDS:
            assert found[shard]["difference"] <= TOLERANCE, (shard, found[shard])
            assert found[shard]["norms"] == pytest.approx(found["none"]["norms"], rel=TOLERANCE), shard


def test_a_sharded_fabric_checkpoint_holds_the_whole_state_and_resumes_as_unsharded(
    four: dict[int, dict[str, Any]],
) -> None:
    saved = report_of(four[0], check_checkpoint_holds_the_whole_state_and_resumes)["saved"]
    assert "error" not in saved, saved["error"]  # rank 0 read both files
    assert saved["same_parameters"] and saved["same_keys"] and saved["same_shapes"], saved
    assert saved["same_param_groups"], saved
    assert saved["entries"] == 3 * saved["optimizer_parameters"]  # AdamW: two moments and a step count each
    assert saved["state_difference"] <= STATE_TOLERANCE, saved
    for rank in range(WORKERS):
        found = report_of(four[rank], check_checkpoint_holds_the_whole_state_and_resumes)
        assert found["remainders"] == {stage: {"step": STEPS // 2} for stage in ("none", *SHARDS)}
        before, after = found["held_before_save"], found["held_after_load"]
        assert after["none"] == before["none"]  # unsharded: the whole state again
        for shard in SHARDS:
            assert after[shard] == before["gradients"], shard  # each worker kept only its slices of the file
            assert found["resumed"][shard] <= TOLERANCE, (shard, found["resumed"])


def test_zero1_trains_under_a_grad_scaler_as_unsharded_and_zero2_refuses_one(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORKERS):
        found = report_of(four[rank], check_a_grad_scaler_under_zero1_and_zero2)
        assert found["scales"]["optimizer"] == found["scales"]["none"] < INITIAL_SCALE  # the same steps skipped
        assert found["norms"]["optimizer"] == pytest.approx(found["norms"]["none"], rel=TOLERANCE, nan_ok=True)
        assert found["difference"] <= TOLERANCE, found["difference"]
        assert found["refused"].startswith("shard='gradients' cannot train with a GradScaler"), found["refused"]


def test_accumulating_without_no_backward_sync_is_refused_naming_the_way(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORKERS):
        found = report_of(four[rank], check_accumulating_without_no_backward_sync_is_refused)
        for shard in SHARDS:
            assert f"shard={shard!r} cannot accumulate gradients with a second backward" in found[shard], found
            assert "fabric.no_backward_sync" in found[shard]


def test_a_fully_sharded_fabric_loop_trains_as_unsharded_holding_no_whole_unit(
    four: dict[int, dict[str, Any]],
) -> None:
    zero = report_of(four[0], check_full_sharding)  # rank 0 gets the gathered state (it writes checkpoints)
    assert zero["difference"] <= TOLERANCE and zero["loaded"] <= TOLERANCE and zero["meta"] <= TOLERANCE, zero
    for rank in range(WORKERS):
        found = report_of(four[rank], check_full_sharding)
        unsharded_norms, sharded_norms, meta_norms = found["norms"]
        assert sharded_norms == pytest.approx(unsharded_norms, rel=TOLERANCE)
        assert meta_norms == pytest.approx(unsharded_norms, rel=TOLERANCE)  # built on the meta device
        whole = found["held"][0]
        assert whole > 0, found["held"]
    for stage in (1, 2):  # every Linear a unit: each worker holds its shards, which together make the model
        held = [report_of(four[rank], check_full_sharding)["held"][stage] for rank in range(WORKERS)]
        assert sum(held) == whole and max(held) < whole / 2, held


@pytest.mark.parametrize("case", ["tied_model_first", "attention", "frozen_base", "split_later"])
def test_zero3_default_units_train_as_unsharded_in_the_order_users_set_up(
    four: dict[int, dict[str, Any]], case: str
) -> None:
    """No policy: the repeated blocks are units and the rest the model's own unit, so a head tied by use and
    ``nn.MultiheadAttention`` (which reads ``out_proj.weight`` itself) train; ``fabric.setup(model)`` then
    ``fabric.setup_optimizers`` (litgpt's order, built in ``init_module(empty_init=True)``) works;
    ``model.state_dict()`` gives every worker the whole tensors, and a prediction after the steps matches
    unsharded. A frozen base under trainable adapters is held as its slices too, between steps and after
    backward; an optimizer set up after the model takes its slices over as they are, frozen ones included (no
    parameter's memory moves). Two optimizers set up after the model that split a unit between them train as
    unsharded too."""
    for rank in range(WORKERS):
        found = report_of(four[rank], check_zero3_in_users_orders)[case]
        assert found["difference"] <= TOLERANCE and found["predicted"] <= TOLERANCE, found
        if case in ("tied_model_first", "frozen_base"):
            assert found["moved"] == [], found
        on_model = 16 * 32 if case == "tied_model_first" else 0  # TiedGPT.position, registered on the model itself
        assert on_model <= found["held_after_step"] < found["whole"] / 2, found
        # once fabric.backward returns, every unit is freed and each parameter's gradient is its shard of the
        # averaged gradient: no worker holds a whole gradient or a whole unit
        after = found["after_backward"]
        assert 0 < after["gradients"] <= after["whole"] < found["whole"] / 2, found
    held = [report_of(four[rank], check_zero3_in_users_orders)[case]["held_after_step"] for rank in range(WORKERS)]
    on_model = 16 * 32 if case == "tied_model_first" else 0
    assert sum(held) == found["whole"] + (WORKERS - 1) * on_model, held  # the shards make the model, once


def test_zero3_local_shards_are_each_workers_part_and_make_the_whole_state(four: dict[int, dict[str, Any]]) -> None:
    """``fabric.strategy.local_shards()``: every worker's parts, laid end to end, are the whole ``state_dict()``."""
    for case in ("tied_model_first", "attention", "frozen_base"):
        whole_everywhere = ["position"] if case == "tied_model_first" else []  # registered on the model itself
        reports = [report_of(four[rank], check_zero3_in_users_orders)[case] for rank in range(WORKERS)]
        for found in reports:
            shards = found["shards"]
            # every sharded parameter, each unit's and the own unit's
            assert shards["names"] == [n for n in shards["state_names"] if n not in whole_everywhere], shards
            assert shards["difference"] == 0.0, shards  # no element missed (NaN), every one as the state holds it
        held = [found["shards"]["held_here"] for found in reports]
        on_model = 16 * 32 if whole_everywhere else 0
        assert sum(held) == reports[0]["whole"] - on_model, held
        assert max(held) - min(held) <= sum(len(f["shards"]["names"]) for f in reports), held  # padding only


def test_zero3_evaluates_with_no_optimizer_sharded_where_it_is_set_up(four: dict[int, dict[str, Any]]) -> None:
    """``fabric.setup(model)`` and no optimizer: the model is sharded there, predicts as unsharded, and after a
    forward that records no gradient holds its shards and what is registered on the model itself."""
    reports = [report_of(four[rank], check_zero3_in_users_orders)["evaluate_alone"] for rank in range(WORKERS)]
    for found in reports:
        assert found["predicted"] <= TOLERANCE, found
    assert sum(found["held"] for found in reports) == reports[0]["whole"] + (WORKERS - 1) * 16 * 32, reports


def test_zero3_model_holds_its_shards_for_torch_tools(four: dict[int, dict[str, Any]]) -> None:
    """Written as plain torch code: after ``fabric.setup(model)`` the parameters are each worker's shards (their
    numel makes the model), a whole state loads into them with no optimizer (``load_state_dict`` and
    ``fabric.load``), and ``torch.nn.utils.clip_grad_norm_`` after ``fabric.backward`` returns the norm over every
    worker and clips as one process with the whole batch does. A parameter kept whole makes it refuse, naming
    ``fabric.clip_gradients``; a backward with no optimizer set up is refused, naming ``fabric.setup_optimizers``."""
    reports = [report_of(four[rank], check_zero3_model_holds_its_shards) for rank in range(WORKERS)]
    whole = reports[0]["whole"]
    assert sum(found["numel_here"] for found in reports) == whole, reports
    assert sum(found["numel_with_optimizer"] for found in reports) == whole, reports
    assert sum(found["shard_gradients"] for found in reports) == whole, reports
    for found in reports:
        assert found["load_difference"] == 0.0, found
        assert found["moved"] == [], found  # the optimizer steps the shards the model held: no copy
        assert found["difference"] <= TOLERANCE, found
        assert found["norms"] == pytest.approx(found["one_process_norms"], rel=TOLERANCE), found
        assert min(found["norms"]) > 0.05, found  # the clip acted
        assert "position" in found["refused"] and "fabric.clip_gradients" in found["refused"], found["refused"]
        assert "fabric.setup_optimizers" in found["backward_alone"], found["backward_alone"]


def test_zero3_names_a_parameter_read_outside_its_unit_and_the_fix(four: dict[int, dict[str, Any]]) -> None:
    """A policy that makes ``nn.MultiheadAttention``'s ``out_proj`` a unit of its own: the first forward stops with a
    note naming the parameter, its unit and the fix."""
    for rank in range(WORKERS):
        text = report_of(four[rank], check_zero3_in_users_orders)["freed_read"]
        for words in ("blocks.0.attention.out_proj.weight", "unit 'blocks.0.attention.out_proj'", "never called",
                      "auto_wrap_policy=None"):  # fmt: skip
            assert words in text, text


def test_torch_clipping_right_after_backward_reads_averaged_gradients(four: dict[int, dict[str, Any]]) -> None:
    """Unsharded (Horovod's DistributedOptimizer) and ZeRO-1: the gradients are averaged as ``fabric.backward``
    ends, so torch's own clipping before the step clips as one process with the whole batch does."""
    for rank in range(WORKERS):
        found = report_of(four[rank], check_torch_clipping_after_backward)
        for shard in ("none", "optimizer"):
            assert found[shard]["difference"] <= TOLERANCE, (shard, found[shard])
            assert found[shard]["norms"] == pytest.approx(found["one_process_norms"], rel=TOLERANCE), shard
