"""LineProgressBar in one process, and which bar the strategy uses."""

from __future__ import annotations

import io
import re
import sys
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import SingleDeviceStrategy
from models import TinyRegression
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch.callbacks import LineProgressBar
from hvd_plugins.pytorch.callbacks import progress as console_bar


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


def test_line_progress_bar_prints_one_line_per_epoch_and_no_carriage_return() -> None:
    stream = io.StringIO()
    _trainer(callbacks=[LineProgressBar(stream=stream)]).fit(TinyRegression(), _loader(), _loader())
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
    model = TinyRegression()
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
    trainer.fit(TinyRegression(), _loader(), _loader())
    trainer.validate(TinyRegression(), _loader())
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
