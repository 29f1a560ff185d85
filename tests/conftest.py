"""Shared fixtures: every multi-process test launches real workers with horovodrun."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hvd_launch import horovodrun_path  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    if shutil.which(horovodrun_path()) is None and not Path(horovodrun_path()).exists():
        raise pytest.UsageError("horovodrun is not installed; run `bash ci/test.sh`, which builds it")
