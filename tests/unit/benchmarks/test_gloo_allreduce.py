"""benchmarks/gloo_allreduce.py without its jobs: the shapes it times, the arguments it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `benchmarks` is a package of the checkout, not of the installed project

from benchmarks import gloo_allreduce  # noqa: E402


def test_gradient_shapes_are_each_layers_weight_then_bias() -> None:
    assert gloo_allreduce.gradient_shapes((3, 5, 2)) == [(5, 3), (5,), (2, 5), (2,)]


def test_gloo_allreduce_refuses_zero_iterations(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        gloo_allreduce.main(["--smoke", "--iterations", "0"])
    assert stop.value.code == 2 and "--iterations 0 must be >= 1" in capsys.readouterr().err
