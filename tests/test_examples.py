"""The examples run end to end: under horovodrun (one node and two emulated nodes), mpirun, and plain python.

tests/unit/examples reads them as text: each shows its Trainer (or Fabric) and its HorovodStrategy, and
states its own flags, so a reader sees every setting in the one file.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import skip_without_mpi
from hvd_launch import REPO, TWO_NODES, run_job, run_mpirun

from hvd_plugins.testing.launch import run_bounded

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.fabric.strategies.launchers.horovod",
    "hvd_plugins.pytorch.strategies.launchers.horovod",
    "hvd_plugins.core.backend.runner",
)

EXAMPLES = REPO / "examples"
SCRIPTS = sorted(path for path in EXAMPLES.glob("*.py") if path.name != "cli.py")
"""The examples that build their Trainer or Fabric themselves; cli.py leaves it to LightningCLI and config.yaml."""


def _printed(pattern: str, output: str) -> list[str]:
    """Lines matching ``pattern`` and where they came from (horovodrun prefixes ``[rank]<stdout>:``)."""
    return [line for line in output.splitlines() if re.search(pattern, line)]


def _metric(pattern: str, output: str) -> float:
    lines = _printed(pattern, output)
    assert len(lines) == 1, f"expected one line matching {pattern!r} (rank 0 only), got {lines}\n{output[-3000:]}"
    assert not lines[0].startswith("[") or re.match(r"\[(\d+,)?0\]<", lines[0]), lines  # horovodrun's or mpirun's tag
    return float(re.search(pattern, lines[0]).group(1))


def _csv_columns(path: Path) -> set[str]:
    with open(path, newline="") as file:
        return set(next(csv.reader(file)))


# ---------------------------------------------------------------------- the parser


def test_daso_flags_without_sync_daso_are_a_parser_error() -> None:
    command = [sys.executable, str(EXAMPLES / "digits.py"), "--daso-warmup-epochs", "1", "--daso-downcast", "fp32"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--daso-warmup-epochs, --daso-downcast: DASO settings need --sync daso" in done.stderr, done.stderr


# ---------------------------------------------------------------------- real runs
@pytest.mark.multiprocess
def test_digits_two_workers_fp16(tmp_path: Path) -> None:
    job = run_job(
        EXAMPLES / "digits.py",
        *("--compression", "fp16", "--epochs", "3", "--monitor", "--no-progress-bar", "--out-dir", str(tmp_path)),
        np=2,
        timeout=420,
        console_script=True,  # the command the example's docstring gives, build probe included
    ).check()
    assert _metric(r"validation accuracy: ([0-9.]+)", job.output) >= 0.9
    assert {"val_acc", "train_loss", "comm/node_local_bytes", "memory/cpu_peak_rss_mb_max"} <= _csv_columns(
        tmp_path / "logs" / "metrics.csv"
    )
    assert (tmp_path / "digits.png").stat().st_size > 10_000


@pytest.mark.multiprocess
def test_digits_two_nodes_daso(tmp_path: Path) -> None:
    job = run_job(
        EXAMPLES / "digits.py",
        # 3 epochs: one of each DASO phase (warmup, cycling, cooldown)
        *("--sync", "daso", "--epochs", "3", "--daso-warmup-epochs", "1", "--daso-cooldown-epochs", "1"),
        *("--daso-max-global-skips", "4", "--daso-downcast", "fp16", "--no-progress-bar", "--out-dir", str(tmp_path)),
        np=4,
        hosts=TWO_NODES,
        timeout=420,
    ).check()
    assert _metric(r"validation accuracy: ([0-9.]+)", job.output) >= 0.85
    assert {"daso/phase", "daso/global_skips"} <= _csv_columns(tmp_path / "logs" / "metrics.csv")
    assert (tmp_path / "digits.png").stat().st_size > 10_000


@pytest.mark.multiprocess
def test_digits_starts_its_own_workers_from_plain_python(tmp_path: Path) -> None:
    """``python examples/digits.py --devices 2``: no launcher; the script starts its second worker itself."""
    command = [sys.executable, str(EXAMPLES / "digits.py"), "--devices", "2", "--epochs", "3", "--accumulate", "2"]
    command += ["--timeline-steps", "1", "3", "--no-progress-bar", "--out-dir", str(tmp_path)]
    job = run_bounded(command, 420, cwd=tmp_path, drop_launcher_env=True)
    assert job.returncode == 0, job.output[-4000:]
    assert _metric(r"validation accuracy: ([0-9.]+)", job.output) >= 0.85
    assert (tmp_path / "timeline.json").stat().st_size > 0
    assert (tmp_path / "digits.png").exists()


@pytest.mark.multiprocess
@pytest.mark.mpi
def test_kg_embedding_under_mpirun_fp16(tmp_path: Path) -> None:
    skip_without_mpi()
    job = run_mpirun(
        EXAMPLES / "kg_embedding.py",
        # a larger learning rate than the example's default reaches the same bar in a tenth of the epochs
        *("--epochs", "4", "--lr", "0.05", "--compression", "fp16", "--no-progress-bar", "--out-dir", str(tmp_path)),
        np=2,
        timeout=420,
    ).check("mpirun")
    assert _metric(r"held-out filtered MRR: ([0-9.]+)", job.output) >= 0.3  # random ranking gives ~0.03


@pytest.mark.multiprocess
def test_kg_embedding_two_nodes_hierarchical(tmp_path: Path) -> None:
    job = run_job(
        EXAMPLES / "kg_embedding.py",
        *("--epochs", "4", "--lr", "0.06", "--sync", "hierarchical", "--no-progress-bar", "--out-dir", str(tmp_path)),
        np=4,
        hosts=TWO_NODES,
        timeout=420,
    ).check()
    assert _metric(r"held-out filtered MRR: ([0-9.]+)", job.output) >= 0.1
    assert {"val_mrr", "val_hits_at_10", "train_loss"} <= _csv_columns(tmp_path / "logs" / "metrics.csv")
    assert (tmp_path / "kg_embedding.png").stat().st_size > 10_000


@pytest.mark.multiprocess
def test_cli_with_yaml_config(tmp_path: Path) -> None:
    job = run_job(
        EXAMPLES / "cli.py",
        *("fit", "--config", str(EXAMPLES / "config.yaml"), "--trainer.max_epochs", "2"),
        *("--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path)),
        np=2,
        timeout=420,
    ).check()
    assert _metric(r"validation accuracy: ([0-9.]+)", job.output) >= 0.85
    assert "val_acc" in _csv_columns(tmp_path / "logs" / "metrics.csv")


@pytest.mark.multiprocess
def test_fabric_example_trains_alike_under_horovodrun_and_from_plain_python(tmp_path: Path) -> None:
    script = EXAMPLES / "fabric_digits.py"
    launched = run_job(script, "--epochs", "6", "--compression", "fp16", np=2, timeout=420).check()
    accuracy = _metric(r"validation accuracy: ([0-9.]+) on 360 images, 2 worker", launched.output)
    assert accuracy >= 0.85
    assert len(_printed(r"^(\[0\]<stdout>:)?epoch \d+/6", launched.output)) == 6  # printed by rank 0 only
    plain = run_bounded(
        [sys.executable, str(script), "--devices", "2", "--epochs", "6", "--compression", "fp16"],
        420,
        cwd=tmp_path,
        drop_launcher_env=True,
    )
    assert plain.returncode == 0, plain.output[-3000:]
    assert _metric(r"validation accuracy: ([0-9.]+) on 360 images, 2 worker", plain.output) == accuracy
