"""Cluster environment and checkpoint IO for Horovod jobs."""

from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment
from hvd_plugins.fabric.plugins.io.atomic import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO", "HorovodEnvironment"]
