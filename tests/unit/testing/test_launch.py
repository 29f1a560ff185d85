from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hvd_plugins.testing.launch import LAUNCH_LOG_ENV, run_bounded


def test_every_launch_is_logged_with_its_test_file_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "launches.tsv"
    monkeypatch.delenv(LAUNCH_LOG_ENV, raising=False)
    assert run_bounded([sys.executable, "-c", "pass"], 60).returncode == 0
    assert not log.exists()
    monkeypatch.setenv(LAUNCH_LOG_ENV, str(log))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_jobs.py::test_one (setup)")
    run_bounded([sys.executable, "-c", "pass"], 60)
    run_bounded([sys.executable, "-c", "raise SystemExit(3)"], 60)
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert [line[:2] for line in lines] == [["tests/test_jobs.py", f"{Path(sys.executable).name} -c"]] * 2
    assert all(float(line[2]) >= 0 for line in lines)
