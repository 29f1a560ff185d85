"""DASO: node-local sync every step, cross-node sync every few steps, driven by the loss."""

from hvd_plugins.core.sync.daso.config import DasoConfig
from hvd_plugins.core.sync.daso.schedule import DasoSchedule, EpochRecord, Phase, StepPlan

__all__ = ["DasoConfig", "DasoSchedule", "EpochRecord", "Phase", "StepPlan"]
