"""Both Lightning packages: names registered in each Trainer, classes of each namespace, clear errors when mixed.

The multi-process jobs of the other test files run under both packages (their ``lightning``
parameter); this file checks what a script sees when it starts with ``import pytorch_lightning as pl``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from _common import report_of
from hvd_launch import LIGHTNING_PACKAGES, REPO, run_job, run_single, scripts_for
from namespace_checks import check_foreign_callback, check_name_and_instance


@pytest.fixture(scope="module")
def plain_process_checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests/workers/namespace_checks.py: Trainers start Horovod, so they run in a process of their own."""
    out = tmp_path_factory.mktemp("namespace_checks")
    job = run_single("namespace_checks.py", out_dir=out)
    assert job.returncode == 0 and 0 in job.results, job.output[-4000:]
    return job.results[0]


def test_a_pytorch_lightning_trainer_takes_the_registered_name_and_the_documented_instance(
    plain_process_checks: dict[str, Any],
) -> None:
    result = report_of(plain_process_checks, check_name_and_instance)
    assert result["by_name_class"] == "hvd_plugins.pytorch_lightning.strategies.horovod.HorovodStrategy"
    assert result["by_name_compression"] == "fp16" and result["instance_kept"]


def test_a_callback_of_the_other_package_is_refused_naming_the_import(plain_process_checks: dict[str, Any]) -> None:
    message = report_of(plain_process_checks, check_foreign_callback)
    if message == "Expected a parent":  # Lightning 2.1 fails on the foreign callback itself, before the strategy
        pytest.skip("this Lightning refuses the other package's callback itself ('Expected a parent')")
    assert message is not None and "from hvd_plugins.pytorch_lightning.callbacks import CommunicationMonitor" in message


def test_a_pytorch_lightning_script_trains_by_name_as_one_plain_process(tmp_path) -> None:
    """``import pytorch_lightning as pl`` and ``pl.Trainer(strategy="horovod")``, as scripts before Lightning 2.0."""
    job = run_single("single_process.py", out_dir=tmp_path, lightning="pytorch_lightning")
    assert job.returncode == 0, job.output[-4000:]
    result = job.results[0]
    assert result["lightning"] == "pytorch_lightning" and result["strategy_module"].startswith(
        "hvd_plugins.pytorch_lightning"
    )
    assert result["world_size"] == 1 and result["final_loss"] < 0.1 * result["first_loss"]


@pytest.mark.multiprocess
def test_the_shared_job_gives_the_same_results_under_both_packages(tmp_path_factory: pytest.TempPathFactory) -> None:
    """strategy_features.py as written for each package: every check passes or fails alike, with equal values."""
    from conftest import two_worker_reports

    by_package = {package: two_worker_reports(package, tmp_path_factory) for package in LIGHTNING_PACKAGES}
    lightning, standalone = by_package["lightning.pytorch"], by_package["pytorch_lightning"]
    for rank in (0, 1):
        assert sorted(lightning[rank]) == sorted(standalone[rank])
        for check, entry in lightning[rank].items():
            other = standalone[rank][check]
            assert other["ok"] == entry["ok"], (check, other.get("error"), entry.get("error"))
            assert _comparable(other.get("value")) == _comparable(entry.get("value")), check


def _comparable(value: object) -> object:
    """A check's value without what differs between any two runs (timings, process ids, paths)."""
    if isinstance(value, dict):
        return {
            k: _comparable(v) for k, v in value.items() if not any(w in k for w in ("seconds", "pid", "path", "dir"))
        }
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    if isinstance(value, str):
        return value.replace("pytorch_lightning", "lightning.pytorch")
    return value


@pytest.mark.multiprocess
def test_lightning_cli_with_the_yaml_config_under_pytorch_lightning(tmp_path) -> None:
    """examples/cli.py and config.yaml as a pytorch_lightning user writes them: class paths of that package."""
    examples = scripts_for(REPO / "examples", "pytorch_lightning")
    assert "pytorch_lightning.HorovodStrategy" in (examples / "config.yaml").read_text()
    job = run_job(
        examples / "cli.py",
        *("fit", "--config", str(examples / "config.yaml"), "--trainer.max_epochs", "2"),
        *("--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path)),
        np=2,
        timeout=420,
    ).check()
    accuracy = re.search(r"validation accuracy: ([0-9.]+)", job.output)
    assert accuracy is not None and float(accuracy.group(1)) >= 0.85, job.output[-3000:]
    assert (tmp_path / "logs" / "metrics.csv").exists()


@pytest.mark.multiprocess
def test_strategy_by_name_under_horovodrun_gives_the_same_training_under_both_packages(tmp_path) -> None:
    """single_process.py (``pl.Trainer(strategy="horovod")``) on 2 workers, as written for each package."""
    results = {}
    for package in LIGHTNING_PACKAGES:
        out = tmp_path / package
        job = run_job("single_process.py", np=2, out_dir=out, timeout=300, lightning=package).check()
        assert sorted(job.results) == [0, 1], job.output[-3000:]
        for result in job.results.values():
            assert result["lightning"] == package and result["world_size"] == 2 and result["is_distributed"]
            face = "hvd_plugins.pytorch." if package == "lightning.pytorch" else "hvd_plugins.pytorch_lightning."
            assert result["strategy_module"].startswith(face)
        results[package] = [job.results[rank]["final_loss"] for rank in (0, 1)]
    assert results["pytorch_lightning"] == results["lightning.pytorch"]  # same code, same numbers
