"""Synchronized BatchNorm for HorovodStrategy, as a Lightning ``LayerSync`` plugin.

``Trainer(sync_batchnorm=True)`` asks for torch's SyncBatchNorm, which needs a torch.distributed
process group that a Horovod job does not have; HorovodStrategy puts this plugin in its place.
It can also be given directly: ``Trainer(plugins=[HorovodSyncBatchNorm()])``.
"""

from __future__ import annotations

from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
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


def horovod_layer_sync(layer_sync: LayerSync | None, sync: str) -> LayerSync | None:
    """The Trainer's layer sync under Horovod: ours in place of torch's, and none with DASO's drifting nodes.

    Under ``sync="daso"`` the nodes' parameters drift apart between cross-node syncs while synchronized
    BatchNorm pools every worker's statistics; measured on a ResNet (``convnet_syncbn`` in
    ``benchmarks/emulated_cluster.py``), the loss diverges once cycling starts. Refused, not left to diverge.
    """
    if isinstance(layer_sync, TorchSyncBatchNorm):  # Trainer(sync_batchnorm=True): torch's needs DDP
        layer_sync = HorovodSyncBatchNorm()
    if layer_sync is not None and sync == "daso":
        raise ValueError(
            f"sync='daso' does not work with synchronized BatchNorm ({type(layer_sync).__name__}, from "
            "Trainer(sync_batchnorm=True) or the plugins list): between cross-node syncs the nodes' parameters "
            "drift apart while the batch statistics span all workers, and training diverges. Keep plain "
            "BatchNorm with sync='daso' (each worker's own statistics, as DASO was designed), or use "
            "sync='hierarchical' or sync='allreduce' with sync_batchnorm=True."
        )
    return layer_sync
