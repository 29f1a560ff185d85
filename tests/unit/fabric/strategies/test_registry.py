"""The registered strategy names, in the Trainer of each Lightning package."""

from __future__ import annotations

import lightning.pytorch as lp
import pytest
import pytorch_lightning as pl
from lightning.pytorch.strategies import StrategyRegistry

import hvd_plugins
from hvd_plugins import HorovodStrategy
from hvd_plugins import pytorch as lightning_face
from hvd_plugins import pytorch_lightning as standalone_face
from hvd_plugins.fabric.strategies.registry import preset_names


@pytest.mark.parametrize(("trainer_package", "face"), [(lp, lightning_face), (pl, standalone_face)])
def test_every_strategy_name_is_registered_with_each_trainer(trainer_package, face) -> None:
    registry = trainer_package.strategies.StrategyRegistry
    for name in preset_names(trainer=True):
        assert registry[name]["strategy"] is face.HorovodStrategy


def test_import_registers_strategy_names() -> None:
    assert hvd_plugins.HorovodStrategy is HorovodStrategy
    for name in ("horovod", "horovod_fp16", "horovod_hierarchical", "horovod_zero1", "horovod_zero2", "horovod_daso"):
        assert name in StrategyRegistry
    assert StrategyRegistry["horovod_fp16"]["init_params"] == {"compression": "fp16"}
