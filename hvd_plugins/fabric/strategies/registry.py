"""The names HorovodStrategy is registered under: the Trainer's StrategyRegistry and Fabric's STRATEGY_REGISTRY.

A few presets for the common choices; everything else goes through the constructor
(``strategy=HorovodStrategy(...)``) or LightningCLI's ``--trainer.strategy``. Importing a face
registers them: Lightning never calls ``register_strategies`` on a third-party strategy class. Both
faces register from this one table; Fabric leaves out what needs the Trainer's epochs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hvd_plugins.fabric.strategies.cluster_choice import choose_horovod_environment_for


class Preset(NamedTuple):
    description: str
    settings: dict[str, Any]
    trainer_only: bool = False


PRESETS: dict[str, Preset] = {
    "horovod": Preset("Horovod: flat allreduce, no compression", {}),
    "horovod_fp16": Preset("Horovod: flat allreduce, gradients sent as float16", {"compression": "fp16"}),
    "horovod_hierarchical": Preset("Horovod: allreduce inside each node, then across nodes", {"sync": "hierarchical"}),
    "horovod_zero1": Preset("Horovod: the optimizer state split over the workers (ZeRO-1)", {"shard": "optimizer"}),
    "horovod_zero2": Preset(
        "Horovod: the optimizer state and the gradients split over the workers (ZeRO-2)", {"shard": "gradients"}
    ),
    "horovod_zero3": Preset(
        "Horovod: the optimizer state, the gradients and the parameters split over the workers (ZeRO-3)",
        {"shard": "parameters"},
    ),
    "horovod_daso": Preset(
        "Horovod: DASO, node-local every step, cross-node every few steps", {"sync": "daso"}, trainer_only=True
    ),
}


def preset_names(trainer: bool) -> list[str]:
    """The names registered with the Trainer (``trainer=True``) or with Fabric."""
    return [name for name, preset in PRESETS.items() if trainer or not preset.trainer_only]


def register_named_strategies(registry: Any, strategy_class: type, connector: type, trainer: bool) -> None:
    """Register the presets with ``registry`` (idempotent: importing again does not raise).

    Each name also gets HorovodEnvironment from ``connector`` under Slurm (see ``cluster_choice``).
    """
    names = preset_names(trainer)
    choose_horovod_environment_for(names, connector)
    for name in names:
        if name not in registry:
            description, settings, _ = PRESETS[name]
            registry.register(name, strategy_class, description=description, **settings)
