"""benchmarks/overhead.py without its jobs: every model it offers builds, at both sizes, from what a worker is given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hvd_plugins.testing import benchmarking as bench

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `benchmarks` is a package of the checkout, not of the installed project

from benchmarks import overhead  # noqa: E402


@pytest.mark.parametrize("model", overhead.MODELS)
def test_overhead_offers_each_model_at_both_sizes_and_a_worker_rebuilds_it(model: str) -> None:
    full, smoke = overhead.FULL[model], overhead.SMOKE[model]
    assert full.model == smoke.model == model and smoke.shared_job and not full.shared_job
    arguments = dict(argument.removeprefix("--").split("=", 1) for argument in smoke.as_args())
    rebuilt = overhead.Setup(model, tuple(json.loads(arguments["size"]).items()), int(arguments["batch-size"]),
                             int(arguments["steps"]), int(arguments["warmup-steps"]), repeats=1)  # fmt: skip
    module = overhead._module(rebuilt)
    assert bench.parameter_count(module) == bench.parameter_count(overhead._module(smoke))
    inputs, labels = overhead._dataset(rebuilt, world=2).tensors
    assert len(inputs) == smoke.batch_size * smoke.steps * 2
    assert module.loss(inputs[: smoke.batch_size], labels[: smoke.batch_size]).isfinite()
