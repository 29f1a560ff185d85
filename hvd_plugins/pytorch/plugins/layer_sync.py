"""Synchronized BatchNorm for HorovodStrategy, as a Lightning ``LayerSync`` plugin.

``Trainer(sync_batchnorm=True)`` asks for torch's SyncBatchNorm, which needs a torch.distributed
process group that a Horovod job does not have; HorovodStrategy puts this plugin in its place.
It can also be given directly: ``Trainer(plugins=[HorovodSyncBatchNorm()])``.
"""

from __future__ import annotations

from lightning.pytorch.plugins.layer_sync import LayerSync
from torch.nn import Module
from typing_extensions import override

from hvd_plugins.core.sync_batchnorm import convert_sync_batchnorm, revert_sync_batchnorm


class HorovodSyncBatchNorm(LayerSync):
    """Replace every BatchNorm layer by one whose batch statistics span all workers (CPU and GPU)."""

    @override
    def apply(self, model: Module) -> Module:
        return convert_sync_batchnorm(model)

    @override
    def revert(self, model: Module) -> Module:
        return revert_sync_batchnorm(model)
