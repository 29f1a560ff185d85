"""Callbacks that show what a distributed run is doing (rank 0 prints, every rank measures), and its progress."""

from hvd_plugins.pytorch.callbacks.comm_stats import CommunicationMonitor, EpochTraffic
from hvd_plugins.pytorch.callbacks.daso import DasoScheduleCallback
from hvd_plugins.pytorch.callbacks.memory import MemorySnapshot, PeakMemoryMonitor, peak_memory_mb
from hvd_plugins.pytorch.callbacks.progress import LineProgressBar
from hvd_plugins.pytorch.callbacks.timeline import HorovodTimeline

__all__ = [
    "CommunicationMonitor",
    "DasoScheduleCallback",
    "EpochTraffic",
    "HorovodTimeline",
    "LineProgressBar",
    "MemorySnapshot",
    "PeakMemoryMonitor",
    "peak_memory_mb",
]
