"""The Fabric-level face: the plugins a Trainer strategy and a Fabric strategy share (environment, checkpoint IO)."""

from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment
from hvd_plugins.fabric.plugins.io.atomic import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO", "HorovodEnvironment"]
