"""What a real 2-worker job prints: progress lines and each warning once, from rank 0 (the pieces in one
process: tests/unit/pytorch/callbacks/test_progress.py, tests/unit/pytorch/utilities/test_rank_zero.py)."""

from __future__ import annotations

import re
from pathlib import Path

from _common import report_of
from console_output import default_bar, disabled_bar, given_bar_kept, warning_as_error_raises
from hvd_launch import run_job

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.pytorch",
    "hvd_plugins.fabric.notices",
    "hvd_plugins.pytorch.callbacks.progress",
    "hvd_plugins.pytorch.utilities.rank_zero",
)


def _lines(output: str, text: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


def test_horovodrun_prints_progress_lines_and_each_warning_once_from_rank_zero(tmp_path: Path) -> None:
    job = run_job("console_output.py", np=2, out_dir=tmp_path, env={"PYTHONWARNINGS": "default"}).check()
    assert sorted(job.results) == [0, 1], job.output[-4000:]
    for rank, report in job.results.items():
        failed = {name: check["error"] for name, check in report.items() if not check["ok"]}
        assert not failed, f"rank {rank}: {failed}"
        assert report_of(report, default_bar) == "LineProgressBar"
        assert report_of(report, given_bar_kept)["type"] == "TQDMProgressBar"
        assert report_of(report, disabled_bar) is None
        assert report_of(report, warning_as_error_raises) is True
    assert report_of(job.results[0], given_bar_kept)["carriage_returns"] > 0  # the user's tqdm bar did draw

    output = job.output
    # The job's output is read as text, where each carriage return of a redrawing bar becomes a line
    # break: the fit that printed (the other two are captured or have no bar) must leave exactly the
    # header and one line per epoch on stdout, all from rank 0.
    stdout = _lines(output, "<stdout>:")
    assert len(stdout) == 3 and all(line.startswith("[0]<stdout>:") for line in stdout), stdout
    assert stdout[0].startswith("[0]<stdout>:training | 2 worker(s) | 2 epochs | 4 batches per epoch")
    for epoch, line in enumerate(stdout[1:], start=1):
        assert re.match(rf"\[0\]<stdout>:epoch {epoch}/2 \| 4 batches in .* \| loss .* \| val_mse ", line), line
    assert not [line for line in output.splitlines() if re.search(r"\d+/\d+ \[\d\d:\d\d<|it/s\]", line)]
    for text, copies in (
        ("UserWarning: console-check: warning before the Trainer", 1),
        ("UserWarning: console-check: warning during training", 1),  # shown once per process, in the first fit
        ("console-check: rank-zero info before the Trainer", 1),
        ("GPU available:", 3),  # one per Trainer
        ("Seed set to 0", 1),
    ):
        found = _lines(output, text)
        assert len(found) == copies and all(line.startswith("[0]<") for line in found), (text, found)
    # Lightning's notices that concern no Horovod user (hvd_plugins/fabric/notices.py) are not shown.
    for notice in ("Tip:", "The `srun` command is available", "LeafSpec"):
        assert not _lines(output, notice), (notice, _lines(output, notice))
