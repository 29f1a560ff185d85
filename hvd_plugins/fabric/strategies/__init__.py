"""Fabric's HorovodStrategy, and the names it is registered under in Fabric's STRATEGY_REGISTRY."""

from hvd_plugins.fabric.strategies.horovod import FABRIC_PRESETS, HorovodStrategy, register_named_strategies

__all__ = ["FABRIC_PRESETS", "HorovodStrategy", "register_named_strategies"]
