"""The Trainer strategy, its launcher and its registered names."""

from hvd_plugins.pytorch.strategies.horovod import HorovodStrategy
from hvd_plugins.pytorch.strategies.registry import PRESETS, register_named_strategies

__all__ = ["PRESETS", "HorovodStrategy", "register_named_strategies"]
