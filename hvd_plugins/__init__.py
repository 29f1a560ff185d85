"""Horovod as a first-class way to train with Lightning 2.x.

Importing this package registers the strategy names ``"horovod"``, ``"horovod_fp16"``,
``"horovod_hierarchical"`` and ``"horovod_daso"`` with Lightning's StrategyRegistry and, inside a
worker started by horovodrun or mpirun, keeps rank-zero messages and warnings to rank 0 from then on.
"""

from lightning.pytorch.strategies import StrategyRegistry

from hvd_plugins.checkpoint_io import AtomicCheckpointIO
from hvd_plugins.comm.counters import CommCounters
from hvd_plugins.config import HorovodConfig
from hvd_plugins.console import follow_launcher_rank
from hvd_plugins.daso.config import DasoConfig
from hvd_plugins.environment import HorovodEnvironment
from hvd_plugins.faults import NonFiniteGradientError
from hvd_plugins.registry import register_named_strategies
from hvd_plugins.strategy import HorovodStrategy

__version__ = "0.1.0"

register_named_strategies(StrategyRegistry)
follow_launcher_rank()

__all__ = [
    "AtomicCheckpointIO",
    "CommCounters",
    "DasoConfig",
    "HorovodConfig",
    "HorovodEnvironment",
    "HorovodStrategy",
    "NonFiniteGradientError",
    "__version__",
]
