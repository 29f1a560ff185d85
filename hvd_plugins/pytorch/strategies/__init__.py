"""The Trainer strategy and its launchers (its names are registered by ``hvd_plugins.fabric.strategies.registry``)."""

from hvd_plugins.pytorch.strategies.horovod import HorovodStrategy

__all__ = ["HorovodStrategy"]
