"""Horovod on a Ray cluster: ``from hvd_plugins.ray import HorovodRayStrategy`` (``pip install hvd_plugins[ray]``)."""

from hvd_plugins.pytorch.strategies.ray import HorovodRayStrategy

__all__ = ["HorovodRayStrategy"]
