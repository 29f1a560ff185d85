"""Full sharding (``shard="parameters"``) on real workers: equal to unsharded training, each worker holding only
the parameters of no unit between computations, whole checkpoints that resume, and clear refusals.

One job of four workers on two emulated nodes (tests/workers/full_shard_checks.py) runs every check; the
same worker written for ``pytorch_lightning``, two workers on two emulated nodes, runs a short equality, the
refusals, and resumes the four workers' checkpoints (whole, and in parts) at its other world size. The whole
checkpoint, and the parts once consolidated, also load into a plain one-process Trainer here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _common import case_argument, report_of
from full_shard_checks import (
    CASES,
    UnitNet,
    check_a_short_run_equals_unsharded,
    check_built_on_the_meta_device,
    check_compiled_units,
    check_equal_to_unsharded,
    check_recompute_with_every_shard,
    check_refusals,
    check_resumed_at_another_world_size,
    check_validation_predict_and_checkpoint,
    check_without_fit_and_with_the_default_units,
)
from hvd_launch import LIGHTNING_PACKAGES, TWO_NODES, run_job

ONE_EACH = "localhost:1,127.0.0.1:1"  # two emulated nodes of one worker

COVERS = (
    "hvd_plugins.core.sync.sharded.stages",
    "hvd_plugins.core.sync.sharded.units",
    "hvd_plugins.pytorch.strategies.unit_init",
)
"""The modules these real jobs exercise beyond their unit files."""

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
"""Of the largest parameter, in float32: the order of the sums is the only difference."""


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("full_shard")
    job = run_job("full_shard_checks.py", np=4, hosts=TWO_NODES, out_dir=out, timeout=900)
    job.check()
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    return job.results


@pytest.fixture(scope="module")
def two(four: dict[int, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Under ``pytorch_lightning``, two workers: the short equality, the refusals, and the four workers'
    checkpoints resumed."""
    out = tmp_path_factory.mktemp("full_shard_pytorch_lightning")
    job = run_job(
        "full_shard_checks.py",
        *case_argument(check_a_short_run_equals_unsharded, check_refusals, check_resumed_at_another_world_size),
        np=2,
        hosts=ONE_EACH,
        out_dir=out,
        timeout=600,
        lightning="pytorch_lightning",
        env={"FULL_SHARD_CHECKPOINTS": ",".join(saved_checkpoints(four))},
    )
    job.check()
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    return job.results


@pytest.fixture(scope="module", params=LIGHTNING_PACKAGES)
def each_package(request: pytest.FixtureRequest) -> dict[int, dict[str, Any]]:
    """The four workers' job under ``lightning.pytorch``, the two workers' under ``pytorch_lightning``."""
    job = "four" if request.param == "lightning.pytorch" else "two"
    reports: dict[int, dict[str, Any]] = request.getfixturevalue(job)
    return reports


def saved_checkpoints(reports: dict[int, dict[str, Any]]) -> tuple[str, str]:
    """The four-worker job's whole checkpoint and its checkpoint in parts."""
    return (
        report_of(reports[0], check_validation_predict_and_checkpoint)["path"],
        report_of(reports[0], check_built_on_the_meta_device)["parts_path"],
    )


def test_a_short_clipped_run_with_a_scheduler_equals_unsharded_under_each_package(
    each_package: dict[int, dict[str, Any]],
) -> None:
    for report in each_package.values():
        found = report_of(report, check_a_short_run_equals_unsharded)
        assert found["difference"] <= TOLERANCE and found["held"] < found["whole"], found


@pytest.mark.parametrize("case", sorted(CASES))
def test_fully_sharded_training_equals_unsharded_and_holds_only_slices_frozen_parameters_too(
    four: dict[int, dict[str, Any]], case: str
) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_equal_to_unsharded)[case]
        assert found["difference"] <= TOLERANCE, found
        assert found["held"] < found["whole"], found  # the Blocks' parameters are slices between computations
        # after a step, what no Block owns (stem, head, a tied embedding) is shards too, and so are frozen ones
        assert found["held_after_step"] < found["whole"], found
        assert (found["frozen"] > 0) == (case == "frozen_base"), found
        # param_dtype="bf16" gathers the units in bfloat16 ("auto" does so on GPUs under bf16-mixed); the Blocks'
        # linear layers compute in bfloat16 under autocast either way: the same values
        gathered = "torch.bfloat16" if case == "bf16_gathers" else "torch.float32"
        assert found["computed_in"] == [gathered], found
    # each worker holds its shards; together they make the model once (twice inside each of two nodes, hybrid)
    held = [report_of(four[rank], check_equal_to_unsharded)[case]["held_after_step"] for rank in range(4)]
    copies = 2 if case == "hybrid_inside_nodes" else 1
    assert sum(held) == copies * found["whole"], held


def test_validation_predict_and_a_whole_checkpoint_that_resumes_sharded(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_validation_predict_and_checkpoint)
        assert found["validated"] <= 1e-5 and found["predicted"] <= 1e-5, found
        assert found["checkpoint_whole"], found
        assert found["resumed"] <= TOLERANCE, found


def test_validate_and_predict_without_fit_run_sharded_and_default_units_train_a_head_tied_by_use(
    four: dict[int, dict[str, Any]],
) -> None:
    """``trainer.validate`` and ``trainer.predict`` alone shard the model (no optimizer): the same results as
    unsharded with nothing held whole after a batch. With no policy, a GPT whose head reads the embedding's weight
    (``norm(h) @ embed.weight.t()``) trains as unsharded: the embedding belongs to the model's own unit."""
    for rank in range(4):
        found = report_of(four[rank], check_without_fit_and_with_the_default_units)
        assert found["validated"] <= 1e-5 and found["predicted"] <= 1e-5, found
        assert found["tied"] <= TOLERANCE, found
    held = [report_of(four[rank], check_without_fit_and_with_the_default_units)["held"] for rank in range(4)]
    assert sum(held) == found["whole"], held  # after each batch, each worker's shards only


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("daso", ["shard='parameters' does not work with sync='daso'"]),
        ("state_dict_types_disagree", ["state_dict_type='full' and shard_checkpoint='parts' disagree"]),
        ("policy_without_full_sharding", ["auto_wrap_policy={", "works only with shard='parameters'"]),
        ("no_unit", ["shard='parameters' found no unit in UnitNet", "auto_wrap_policy={Block}"]),
        ("half_norms_on_cpu", ["param_dtype='bfloat16' gathers the units in half", "['blocks.1']", "'full'"]),
    ],
)
def test_what_full_sharding_cannot_do_is_refused_before_training(
    each_package: dict[int, dict[str, Any]], case: str, words: list[str]
) -> None:
    for report in each_package.values():
        message = report_of(report, check_refusals)[case]
        assert all(word in message for word in words), message


@pytest.mark.parametrize("build", ["init_module", "configure_model"])
def test_a_model_built_on_the_meta_device_trains_as_the_one_built_whole(
    four: dict[int, dict[str, Any]], build: str
) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_built_on_the_meta_device)[build]
        assert found["on_meta"], found
        assert found["difference"] <= TOLERANCE and found["held"] < found["whole"], found


def test_activation_checkpointing_with_every_shard_equals_plain_training(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_recompute_with_every_shard)
        assert sorted(found) == ["gradients", "none", "optimizer"], found
        assert all(difference <= TOLERANCE for difference in found.values()), found


def test_both_checkpoint_forms_resume_fully_sharded_at_another_world_size(two: dict[int, dict[str, Any]]) -> None:
    for report in two.values():
        found = report_of(report, check_resumed_at_another_world_size)
        assert found["full"] <= TOLERANCE and found["parts"] <= TOLERANCE, found


def test_both_checkpoint_forms_load_into_a_plain_one_process_trainer(
    four: dict[int, dict[str, Any]], tmp_path: Path
) -> None:
    import lightning.pytorch as pl

    full, parts = saved_checkpoints(four)
    consolidated = tmp_path / "consolidated.ckpt"
    subprocess.run(
        [sys.executable, "-m", "hvd_plugins.consolidate", parts, "--output", str(consolidated)], check=True
    )
    for path, module in ((full, UnitNet("adamw", scheduler=True)), (str(consolidated), UnitNet(seed=None))):
        loaded = torch.load(path, weights_only=False)["state_dict"]
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False
        )
        trainer.fit(module, ckpt_path=path)
        assert trainer.current_epoch == 3 and trainer.global_step > 0
        changed = [not torch.equal(loaded[name], value) for name, value in module.state_dict().items()]
        assert any(changed) and all(torch.isfinite(p).all() for p in module.parameters())


def test_compiled_units_train_as_eager_without_breaks_inside_a_block(four: dict[int, dict[str, Any]]) -> None:
    for rank in range(4):
        found = report_of(four[rank], check_compiled_units)
        assert found["blocks"]["difference"] <= TOLERANCE and found["stack"]["difference"] <= TOLERANCE, found
        assert found["blocks"]["graph_breaks"] == 0, found  # each block one graph, the gathers outside it
