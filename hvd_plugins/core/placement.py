"""Where the model lives between setup and teardown: whole on every worker, or as this worker's shards.

Both strategies ask a ``ModelPlacement`` what the shard mode means for the model itself (how it is built, made
ready, set up with no optimizer, and loaded), so that the choice is made once, here (``placement_for``), and not
at each step of their setup. ``shard="parameters"`` shards the model where it is set up, as FSDP's
``fully_shard`` does; every other mode keeps it whole, as DDP does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import Module

from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.training_state import broadcast_module_, prepare_module_, shape_placeholders_


class ModelPlacement:
    """The model whole on every worker: built where Lightning builds it, rank 0's values broadcast at setup and after
    a load, and nothing to do before an optimizer exists."""

    restores_after_setup = False
    """Whether a checkpoint is loaded once the model is set up (into its shards) rather than before."""

    def builds_on_meta(self, empty_init: bool | None) -> bool:
        """Whether ``init_module()`` (and the Trainer's ``configure_model``) build on the meta device."""
        return False

    def prepare(self, model: Module, device: torch.device) -> None:
        """The model on ``device``, real, and rank 0's on every worker."""
        prepare_module_(model, device, keep_meta=False)

    def set_up_alone(self, shard: Callable[[], object]) -> None:
        """A model set up with no optimizer (Fabric's ``setup_module``, the Trainer's validate, test and predict):
        whole, it needs nothing more; ``shard`` would shard it."""

    def sharded_model(self, model: Module) -> Module | None:
        """The model that optimizers set up later are laid over, sharded (None: each optimizer stands alone)."""
        return None

    def before_optimizers(self, model: Module) -> None:
        """Called before optimizers are laid over ``model``."""

    def after_load(self, model: Module) -> None:
        """Every worker takes rank 0's loaded values."""
        broadcast_module_(model)


class ShardedPlacement(ModelPlacement):
    """``shard="parameters"``: built on the meta device unless ``empty_init=False``; sharded where it is set up, with
    or without an optimizer, a unit at a time, so that no worker holds it whole; loaded into each worker's shards."""

    restores_after_setup = True

    def builds_on_meta(self, empty_init: bool | None) -> bool:
        return empty_init is not False

    def prepare(self, model: Module, device: torch.device) -> None:
        """What is real to ``device``; what is on the meta device the sync makes real a unit at a time, and broadcasts
        per unit (workers may differ in what is real after an elastic reset)."""
        prepare_module_(model, device, keep_meta=True)

    def set_up_alone(self, shard: Callable[[], object]) -> None:
        """Sharded now by ``shard``; the slices must train later, whatever mode the caller runs in."""
        with torch.inference_mode(False), torch.enable_grad():
            shard()

    def sharded_model(self, model: Module) -> Module | None:
        return model

    def before_optimizers(self, model: Module) -> None:
        """Units left as placeholders (an elastic reset) take their shapes again, to be made real as they are laid
        out for the optimizers."""
        shape_placeholders_(model)

    def after_load(self, model: Module) -> None:
        """Nothing to send: each worker read its own slices."""


def placement_for(config: HorovodConfig) -> ModelPlacement:
    """The one place the strategies' setup learns whether the shard mode shards the model."""
    return ShardedPlacement() if config.shards_parameters else ModelPlacement()
