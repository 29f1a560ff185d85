"""Where ranks and sizes come from: Horovod."""

from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment

__all__ = ["HorovodEnvironment"]
