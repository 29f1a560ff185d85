"""benchmarks/background_progress.py without its jobs: the shard it sends, the worker counts it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `benchmarks` is a package of the checkout, not of the installed project

from benchmarks import background_progress  # noqa: E402


def test_background_progress_shard_is_the_nodes_share_of_the_parameters() -> None:
    assert background_progress.shard_numel((3, 5, 2), local_size=1) == 32  # 3*5 + 5 + 5*2 + 2
    assert background_progress.shard_numel((3, 5, 2), local_size=3) == 11  # the last shard padded


@pytest.mark.parametrize(
    ("workers", "message"), [("3", "--workers 3 must be an even number"), ("2,x", "whole numbers")]
)
def test_background_progress_refuses_worker_counts_that_make_no_two_nodes(
    workers: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        background_progress.main(["--smoke", "--workers", workers])
    assert stop.value.code == 2 and message in capsys.readouterr().err
