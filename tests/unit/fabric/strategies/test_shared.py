"""What both strategies do alike: the model's state is saved and loaded through the sync mode, the sync's own state
rides in the checkpoint, whichever mode runs (and by the module itself before a sync exists)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.fabric.strategies.shared import CHECKPOINT_KEY


class GatheringSync(GradientSync):
    """A mode that owns the model's state, as one splitting parameters would: it says what it saved and loaded."""

    def __init__(self) -> None:
        self.loaded: list[tuple[dict[str, Any], bool]] = []

    def synchronize(self, optimizer: Optimizer) -> None:
        """Nothing to average here."""

    def model_state_dict(self, model: Module) -> dict[str, Any]:
        return {"gathered": torch.ones(2)}

    def load_model_state_dict(self, model: Module, state: Mapping[str, Any], strict: bool = True) -> None:
        self.loaded.append((dict(state), strict))

    def state_dict(self) -> dict[str, Any]:
        return {"phase": "cycling"}


@pytest.fixture(params=["fabric", "trainer"])
def strategy_and_model(request: pytest.FixtureRequest) -> tuple[Any, Module]:
    model = torch.nn.Linear(2, 1)
    if request.param == "fabric":
        from hvd_plugins.fabric import HorovodStrategy as FabricStrategy

        return FabricStrategy(), model
    import lightning.pytorch as pl

    from hvd_plugins.pytorch import HorovodStrategy

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = model

    strategy = HorovodStrategy()
    strategy._lightning_module = Tiny()
    return strategy, strategy._lightning_module


def saved(strategy: Any, model: Module) -> dict[str, Any]:
    return strategy.get_module_state_dict(model) if hasattr(strategy, "get_module_state_dict") else (
        strategy.lightning_module_state_dict()
    )


def load(strategy: Any, model: Module, state: dict[str, Any]) -> None:
    if hasattr(strategy, "load_module_state_dict"):
        strategy.load_module_state_dict(model, state, strict=False)
    else:
        strategy.load_model_state_dict({"state_dict": state}, strict=False)


def test_the_model_state_goes_through_the_sync_mode(strategy_and_model: tuple[Any, Module]) -> None:
    strategy, model = strategy_and_model
    strategy.gradient_sync = GatheringSync()
    assert list(saved(strategy, model)) == ["gathered"]
    load(strategy, model, {"gathered": torch.zeros(2)})
    assert [(list(state), strict) for state, strict in strategy.gradient_sync.loaded] == [(["gathered"], False)]


def test_before_a_sync_exists_the_module_saves_and_loads_itself(strategy_and_model: tuple[Any, Module]) -> None:
    strategy, model = strategy_and_model
    state = saved(strategy, model)
    assert state.keys() == model.state_dict().keys()
    load(strategy, model, {key: torch.full_like(value, 3.0) for key, value in state.items()})
    assert all(bool((value == 3.0).all()) for value in model.state_dict().values())


def test_the_syncs_own_state_rides_in_the_checkpoint_and_comes_back(strategy_and_model: tuple[Any, Module]) -> None:
    strategy, _ = strategy_and_model
    strategy.gradient_sync = GatheringSync()
    checkpoint: dict[str, Any] = {}
    strategy._add_sync_state(checkpoint)
    assert checkpoint[CHECKPOINT_KEY] == {"phase": "cycling"}
    strategy.gradient_sync = None
    strategy._take_sync_state(checkpoint)
    assert strategy._restored_sync_state == {"phase": "cycling"}  # for the sync the next setup builds
