"""Trainer plugins: synchronized BatchNorm (the cluster environment and checkpoint IO come from the Fabric face)."""

from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment
from hvd_plugins.fabric.plugins.io.atomic import AtomicCheckpointIO
from hvd_plugins.pytorch.plugins.layer_sync import HorovodSyncBatchNorm

__all__ = ["AtomicCheckpointIO", "HorovodEnvironment", "HorovodSyncBatchNorm"]
