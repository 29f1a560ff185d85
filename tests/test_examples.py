"""The examples run end to end under horovodrun (one node and two emulated nodes) and as one process."""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

import pytest
from hvd_launch import REPO, TWO_NODES, run_job, run_single

from hvd_plugins.testing.launch import run_bounded

EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))

import common  # noqa: E402

from hvd_plugins import DasoConfig  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    common.add_training_flags(parser, epochs=1, batch_size=8, lr=0.1)
    common.add_strategy_flags(parser)
    return parser


def _printed(pattern: str, output: str) -> list[str]:
    """Lines matching ``pattern`` and where they came from (horovodrun prefixes ``[rank]<stdout>:``)."""
    return [line for line in output.splitlines() if re.search(pattern, line)]


def _metric(pattern: str, output: str) -> float:
    lines = _printed(pattern, output)
    assert len(lines) == 1, f"expected one line matching {pattern!r} (rank 0 only), got {lines}\n{output[-3000:]}"
    assert not lines[0].startswith("[") or lines[0].startswith("[0]"), lines
    return float(re.search(pattern, lines[0]).group(1))


def _csv_columns(path: Path) -> set[str]:
    with open(path, newline="") as file:
        return set(next(csv.reader(file)))


# ---------------------------------------------------------------------- flags -> strategy, no processes
def test_every_daso_setting_has_a_flag_and_reaches_the_strategy() -> None:
    flags = [f"--daso-{name.replace('_', '-')}" for name in DasoConfig().as_dict() if name != "verbose"]
    values = {"--daso-downcast": "fp32", "--daso-stability-level": "0.1"}
    argv = ["--sync", "daso", "--daso-verbose"]
    for flag in flags:
        argv += [flag, values.get(flag, "3")]
    strategy = common.strategy_from_args(_parser().parse_args(argv))
    config = strategy.config.daso
    assert config is not None and config.downcast == "fp32" and config.stability_level == 0.1
    assert config.warmup_epochs == 3 and config.max_global_skips == 3 and config.verbose is True


def test_strategy_flags_reach_the_strategy() -> None:
    args = _parser().parse_args(
        ["--compression", "fp16", "--sync", "hierarchical", "--op", "sum", "--scale-lr", "--flat-below-mb", "2"]
    )
    strategy = common.strategy_from_args(args)
    config = strategy.config
    assert (config.compression, config.sync, config.op, config.flat_below_mb) == ("fp16", "hierarchical", "sum", 2.0)
    assert config.scale_lr and config.daso is None


def test_every_strategy_argument_has_a_flag() -> None:
    """The flags are read from HorovodStrategy's signature, so none can be missing or drift."""
    import inspect

    flags = {action.dest for action in _parser()._actions}
    arguments = set(inspect.signature(common.HorovodStrategy.__init__).parameters) - {"self"}
    assert arguments - common.STRATEGY_FLAGS_SKIPPED <= flags


def test_daso_flags_without_sync_daso_are_refused() -> None:
    args = _parser().parse_args(["--daso-warmup-epochs", "1"])
    with pytest.raises(ValueError, match="--daso-warmup-epochs given with --sync allreduce"):
        common.strategy_from_args(args)


def test_bad_choices_are_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--compression", "int8"])


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
def test_kg_embedding_two_workers(tmp_path: Path) -> None:
    job = run_job(
        EXAMPLES / "kg_embedding.py",
        # a larger learning rate than the example's default reaches the same bar in half the epochs
        *("--epochs", "4", "--lr", "0.05", "--compression", "fp16", "--no-progress-bar", "--out-dir", str(tmp_path)),
        np=2,
        timeout=420,
    ).check()
    assert _metric(r"held-out filtered MRR: ([0-9.]+)", job.output) >= 0.3  # random ranking gives ~0.03
    assert {"val_mrr", "val_hits_at_10"} <= _csv_columns(tmp_path / "logs" / "metrics.csv")
    assert (tmp_path / "kg_embedding.png").stat().st_size > 10_000


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
    assert (tmp_path / "logs" / "metrics.csv").exists() and (tmp_path / "kg_embedding.png").exists()


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
def test_digits_as_one_plain_process(tmp_path: Path) -> None:
    job = run_single(
        EXAMPLES / "digits.py", "--epochs", "2", "--no-progress-bar", "--out-dir", str(tmp_path), timeout=300
    )
    assert job.returncode == 0, job.output[-4000:]
    assert _metric(r"validation accuracy: ([0-9.]+)", job.output) >= 0.85
    assert (tmp_path / "digits.png").exists()


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
