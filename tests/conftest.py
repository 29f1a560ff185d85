"""Shared fixtures: every multi-process test launches real workers with horovodrun."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hvd_launch import LIGHTNING_PACKAGES, horovodrun_path, run_job  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    if shutil.which(horovodrun_path()) is None and not Path(horovodrun_path()).exists():
        raise pytest.UsageError("horovodrun is not installed; run `bash ci/test.sh`, which builds it")


_two_worker_reports: dict[str, dict[int, dict]] = {}


def two_worker_reports(lightning: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Every rank's report of the one two-worker, one-node job of named checks (tests/workers/strategy_features.py),
    with the worker written for ``lightning`` ("lightning.pytorch" or "pytorch_lightning"); run once per package.

    Shared by the Lightning-feature tests and the fault tests: one launch instead of one per file.
    Each check is recorded on its own, so a failing check fails only the tests that read it.
    """
    if lightning not in _two_worker_reports:
        out = tmp_path_factory.mktemp(f"two_worker_checks_{lightning.replace('.', '_')}")
        job = run_job("strategy_features.py", np=2, out_dir=out, timeout=900, lightning=lightning).check()
        assert sorted(job.results) == [0, 1], job.output[-3000:]
        _two_worker_reports[lightning] = job.results
    return _two_worker_reports[lightning]


@pytest.fixture(scope="session", params=LIGHTNING_PACKAGES)
def two_worker_checks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The shared two-worker job's reports, once with each Lightning package."""
    return two_worker_reports(request.param, tmp_path_factory)
