"""Names under which HorovodStrategy is registered in the Trainer's StrategyRegistry.

A few presets for the common choices; everything else goes through the constructor
(``Trainer(strategy=HorovodStrategy(...))``) or LightningCLI's ``--trainer.strategy``.
Importing the face registers them: Lightning never calls ``register_strategies`` on a
third-party strategy class.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from hvd_plugins.fabric.strategies.cluster_choice import choose_horovod_environment_for
from hvd_plugins.pytorch.strategies.horovod import HorovodStrategy

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "horovod": ("Horovod: flat allreduce, no compression", {}),
    "horovod_fp16": ("Horovod: flat allreduce, gradients sent as float16", {"compression": "fp16"}),
    "horovod_hierarchical": ("Horovod: allreduce inside each node, then across nodes", {"sync": "hierarchical"}),
    "horovod_daso": ("Horovod: DASO, node-local every step, cross-node every few steps", {"sync": "daso"}),
}


def register_named_strategies(strategy_registry: Any) -> None:
    """Register every preset (idempotent: re-importing does not raise); each name gets HorovodEnvironment."""
    choose_horovod_environment_for(PRESETS, _AcceleratorConnector)
    for name, (description, init_params) in PRESETS.items():
        if name in strategy_registry:
            continue
        strategy_registry.register(name, HorovodStrategy, description=description, **init_params)
