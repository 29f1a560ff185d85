"""What jobs print: the line-based progress bar, which bar the strategy picks, warnings once."""

from __future__ import annotations

import io
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hvd_launch import run_job
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.core.backend.launch_env import launcher_rank
from hvd_plugins.pytorch.callbacks import LineProgressBar
from hvd_plugins.pytorch.callbacks import progress as console_bar
from hvd_plugins.pytorch.utilities import rank_zero


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_mse", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)


def _trainer(**kwargs: Any) -> Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return Trainer(**options)


# ---------------------------------------------------------------------- LineProgressBar, one process
def test_line_progress_bar_prints_one_line_per_epoch_and_no_carriage_return() -> None:
    stream = io.StringIO()
    _trainer(callbacks=[LineProgressBar(stream=stream)]).fit(_Tiny(), _loader(), _loader())
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "training | 1 worker(s) | 2 epochs | 4 batches per epoch and worker"
    number = r"[\d.e+-]+"
    for epoch, line in enumerate(lines[1:], start=1):
        pattern = rf"epoch {epoch}/2 \| 4 batches in {number} s \| {number} it/s \| loss {number} \| val_mse {number}"
        assert re.fullmatch(pattern, line), line
    assert len(lines) == 3


def test_line_progress_bar_shows_the_step_loss_not_the_one_divided_for_accumulation() -> None:
    """Lightning hands callbacks the loss divided by accumulate_grad_batches; the line shows the steps' own mean."""
    stream = io.StringIO()
    model = _Tiny()
    torch.manual_seed(3)
    loader = _loader()
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)  # the model does not move: the losses can be recomputed
    model.configure_optimizers = lambda: frozen  # type: ignore[method-assign]
    _trainer(callbacks=[LineProgressBar(stream=stream)], max_epochs=1, accumulate_grad_batches=4).fit(model, loader)
    printed = float(re.search(r"\| loss ([\d.e+-]+)", stream.getvalue().splitlines()[-1]).group(1))
    with torch.no_grad():
        expected = sum(float(model.training_step(batch, 0)) for batch in loader) / len(loader)
    assert printed == pytest.approx(expected, rel=1e-3)


def test_line_progress_bar_refreshes_inside_epochs_and_validations() -> None:
    stream = io.StringIO()
    bar = LineProgressBar(refresh_seconds=1e-9, stream=stream)
    trainer = _trainer(callbacks=[bar], max_epochs=1, val_check_interval=0.5, num_sanity_val_steps=0)
    trainer.fit(_Tiny(), _loader(), _loader())
    trainer.validate(_Tiny(), _loader())
    lines = stream.getvalue().splitlines()
    assert [line for line in lines if " | batch " in line] == [
        line for line in lines if re.match(r"epoch 1/1 \| batch [123]/4 \| [\d.]+ it/s \| loss ", line)
    ]
    assert len([line for line in lines if " | batch " in line]) == 3  # the 4th batch ends the epoch: its own line
    assert sum(line.startswith("epoch 1/1 | validation after batch 2 | 4 batches in ") for line in lines) == 1
    assert sum(line.startswith("epoch 1/1 | validation batch ") for line in lines) == 2 * 3
    assert lines[-1].startswith("validation | 4 batches in ") and " | val_mse " in lines[-1]


def test_disabled_line_progress_bar_prints_nothing() -> None:
    stream = io.StringIO()
    bar = LineProgressBar(stream=stream)
    bar.disable()
    bar.print("hidden")
    assert stream.getvalue() == "" and not bar.is_enabled
    bar.enable()
    bar.print("shown", 1)
    bar.print("a", "b", sep="-")
    assert stream.getvalue() == "shown 1\na-b\n"
    with pytest.raises(ValueError, match="refresh_seconds=0"):
        LineProgressBar(refresh_seconds=0)


# ---------------------------------------------------------------------- which bar the strategy uses
class _RecordingStrategy(SingleDeviceStrategy):
    """Lightning calls ``set_world_ranks`` inside ``Trainer.__init__``, as it does for HorovodStrategy."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.bar_given: bool | None = None

    def set_world_ranks(self) -> None:
        self.bar_given = console_bar.progress_bar_given_to_trainer()


class _MyTQDM(TQDMProgressBar):
    pass


@pytest.mark.parametrize(
    ("callbacks", "given"),
    [(None, False), ([], False), ([TQDMProgressBar()], True), (TQDMProgressBar(), True), ([LineProgressBar()], True)],
)
def test_a_progress_bar_given_to_the_trainer_is_recognised(callbacks: Any, given: bool) -> None:
    strategy = _RecordingStrategy()
    Trainer(strategy=strategy, callbacks=callbacks, logger=False, enable_checkpointing=False)
    assert strategy.bar_given is given


def test_outside_a_trainer_nobody_knows_whether_a_bar_was_given() -> None:
    assert console_bar.progress_bar_given_to_trainer() is None


def test_only_lightnings_default_bar_is_replaced() -> None:
    trainer = _trainer()
    assert type(trainer.progress_bar_callback) is TQDMProgressBar  # Lightning's default (rich is not installed)
    assert not console_bar.use_line_progress_bar(trainer, bar_given=None, world_size=2)  # unknown: left alone
    assert not console_bar.use_line_progress_bar(trainer, bar_given=True, world_size=2)
    assert console_bar.use_line_progress_bar(trainer, bar_given=False, world_size=2)
    assert isinstance(trainer.progress_bar_callback, LineProgressBar)
    assert sum(isinstance(c, (TQDMProgressBar, LineProgressBar)) for c in trainer.callbacks) == 1
    custom = _trainer(callbacks=[_MyTQDM()])
    assert not console_bar.use_line_progress_bar(custom, bar_given=False, world_size=2)
    assert not console_bar.use_line_progress_bar(_trainer(enable_progress_bar=False), bar_given=False, world_size=2)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tqdm_stays_in_a_terminal_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert not console_bar.tqdm_reads_badly(world_size=1)
    assert console_bar.tqdm_reads_badly(world_size=2)
    monkeypatch.setenv("HOROVOD_RANK", "0")
    assert console_bar.tqdm_reads_badly(world_size=1)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.delenv("HOROVOD_RANK")
    assert console_bar.tqdm_reads_badly(world_size=1)  # piped to a file


# ---------------------------------------------------------------------- warnings on ranks > 0
@pytest.fixture
def rank_restored() -> Iterator[None]:
    rank = rank_zero_only.rank
    yield
    rank_zero.follow_rank(rank)


def _shown(message: str) -> str:
    stream = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown_by = warnings.showwarning
        if shown_by is not rank_zero._drop_warning:  # write where the test can read it
            warnings.showwarning = lambda *args: stream.write(warnings.formatwarning(*args[:4]))
        warnings.warn(message, UserWarning, stacklevel=1)
    return stream.getvalue()


@pytest.mark.usefixtures("rank_restored")
def test_ranks_above_zero_display_no_warnings_but_still_raise_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rank_zero.ALL_RANK_WARNINGS_ENV, raising=False)
    rank_zero.follow_rank(1)
    assert rank_zero_only.rank == 1
    assert _shown("from rank 1") == ""
    with warnings.catch_warnings(), pytest.raises(UserWarning, match="escalated"):
        warnings.simplefilter("error")
        warnings.warn("escalated", UserWarning, stacklevel=1)
    rank_zero.follow_rank(0)
    assert "from rank 0" in _shown("from rank 0")


@pytest.mark.usefixtures("rank_restored")
def test_all_rank_warnings_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rank_zero.ALL_RANK_WARNINGS_ENV, "1")
    rank_zero.follow_rank(1)
    assert "from rank 1" in _shown("from rank 1")


def test_launcher_rank_is_read_from_the_launchers_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launcher_rank() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert launcher_rank() == 3


# ---------------------------------------------------------------------- a real 2-worker job
def _lines(output: str, text: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


def test_horovodrun_prints_progress_lines_and_each_warning_once_from_rank_zero(tmp_path: Path) -> None:
    job = run_job("console_output.py", np=2, out_dir=tmp_path, env={"PYTHONWARNINGS": "default"}).check()
    assert sorted(job.results) == [0, 1], job.output[-4000:]
    for rank, report in job.results.items():
        failed = {name: check["error"] for name, check in report.items() if not check["ok"]}
        assert not failed, f"rank {rank}: {failed}"
        assert report["default_bar"]["value"] == "LineProgressBar"
        assert report["given_bar_kept"]["value"]["type"] == "TQDMProgressBar"
        assert report["disabled_bar"]["value"] is None
        assert report["warning_as_error_raises"]["value"] is True
    assert job.results[0]["given_bar_kept"]["value"]["carriage_returns"] > 0  # the user's tqdm bar did draw

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
    ):
        found = _lines(output, text)
        assert len(found) == copies and all(line.startswith("[0]<") for line in found), (text, found)
