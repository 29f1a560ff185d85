"""Fabric's HorovodStrategy, and the names both faces register it under (``registry``)."""

from hvd_plugins.fabric.strategies.horovod import HorovodStrategy
from hvd_plugins.fabric.strategies.registry import PRESETS, register_named_strategies

__all__ = ["PRESETS", "HorovodStrategy", "register_named_strategies"]
