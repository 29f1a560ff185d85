"""The Fabric face: ``Fabric(strategy="horovod")`` and the plugins a Trainer strategy and a Fabric strategy share.

Importing it registers ``"horovod"``, ``"horovod_fp16"`` and ``"horovod_hierarchical"`` with Fabric's
STRATEGY_REGISTRY; ``ElasticLoop`` runs a Fabric loop elastically (docs/elastic.rst). The same source
serves ``lightning_fabric`` as ``hvd_plugins.lightning_fabric``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from hvd_plugins.fabric.elastic import ElasticLoop
from hvd_plugins.fabric.lightning_internals import FabricConnector
from hvd_plugins.fabric.notices import quiet_lightning_notices
from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment
from hvd_plugins.fabric.plugins.io.atomic import AtomicCheckpointIO
from hvd_plugins.fabric.strategies import HorovodStrategy, register_named_strategies
from hvd_plugins.fabric.strategies.ray import HorovodRayStrategy

register_named_strategies(STRATEGY_REGISTRY, HorovodStrategy, FabricConnector, trainer=False)
quiet_lightning_notices()

__all__ = ["AtomicCheckpointIO", "ElasticLoop", "HorovodEnvironment", "HorovodRayStrategy", "HorovodStrategy"]
