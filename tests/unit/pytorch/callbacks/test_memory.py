"""PeakMemoryMonitor's readings."""

from __future__ import annotations

import torch

from hvd_plugins.pytorch.callbacks import peak_memory_mb


def test_peak_memory_is_measured_on_cpu() -> None:
    readings = peak_memory_mb(torch.device("cpu"))
    assert readings["cpu_peak_rss_mb"] > 1.0
    assert not any(name.startswith("gpu") for name in readings)
