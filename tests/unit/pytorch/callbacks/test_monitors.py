"""The monitoring callbacks together in a plain single-device fit, where no Horovod runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from models import TinyRegression
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.pytorch.callbacks import CommunicationMonitor, HorovodTimeline, PeakMemoryMonitor


def test_callbacks_are_harmless_without_horovod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")  # restored afterwards, whatever the callback sets
    memory, comm = PeakMemoryMonitor(print_table=False), CommunicationMonitor()
    timeline = HorovodTimeline(tmp_path / "timeline.json", start_step=0, stop_step=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        callbacks=[memory, comm, timeline],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    with pytest.warns(UserWarning, match="no comm_counters"):
        trainer.fit(TinyRegression(lr=0.1), DataLoader(data, batch_size=4))
    assert comm.history == []
    assert [s.stage for s in memory.history] == ["train_start", "epoch_end", "epoch_end", "train_end"]
    assert all(len(values) == 1 and values[0] >= 0 for s in memory.history for values in s.per_worker.values())
    assert all(s.per_worker["cpu_peak_rss_mb"][0] > 0 and s.per_worker["parameters_mb"][0] > 0 for s in memory.history)
    assert memory.history[-1].per_worker["optimizer_state_mb"] >= [0.0]
    assert not (tmp_path / "timeline.json").exists()
