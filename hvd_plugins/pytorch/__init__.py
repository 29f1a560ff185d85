"""HorovodStrategy, its plugins and callbacks for the Trainer of ``lightning.pytorch``.

Importing this face registers the strategy names (``"horovod"``, ``"horovod_fp16"``,
``"horovod_hierarchical"``, ``"horovod_daso"``) with its Trainer's StrategyRegistry and, inside a
worker started by horovodrun, mpirun or srun, keeps rank-zero messages and warnings to rank 0. It also
lets its Trainer take a ``torch.compile``-d LightningModule under ``HorovodStrategy``.
The same source serves both Lightning packages (``hvd_plugins.mirror``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from hvd_plugins.fabric.lightning_internals import TrainerConnector, allow_compiled_models
from hvd_plugins.fabric.notices import quiet_lightning_notices
from hvd_plugins.fabric.plugins import AtomicCheckpointIO, HorovodEnvironment
from hvd_plugins.fabric.strategies.registry import register_named_strategies
from hvd_plugins.pytorch.callbacks import (
    CommunicationMonitor,
    DasoScheduleCallback,
    HorovodTimeline,
    LineProgressBar,
    PeakMemoryMonitor,
)
from hvd_plugins.pytorch.plugins.layer_sync import HorovodSyncBatchNorm
from hvd_plugins.pytorch.strategies import HorovodStrategy
from hvd_plugins.pytorch.utilities.rank_zero import follow_launcher_rank

register_named_strategies(StrategyRegistry, HorovodStrategy, TrainerConnector, trainer=True)
allow_compiled_models(HorovodStrategy)  # trainer.fit(torch.compile(model)), as under DDP
follow_launcher_rank()
quiet_lightning_notices()

__all__ = [
    "AtomicCheckpointIO",
    "CommunicationMonitor",
    "DasoScheduleCallback",
    "HorovodEnvironment",
    "HorovodStrategy",
    "HorovodSyncBatchNorm",
    "HorovodTimeline",
    "LineProgressBar",
    "PeakMemoryMonitor",
]
