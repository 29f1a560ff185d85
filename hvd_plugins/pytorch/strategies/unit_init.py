"""Where the Trainer builds and places a model that ``shard="parameters"`` splits: on the meta device, so that
no worker holds it whole; each worker makes only its slices real at setup (``core.sync.meta``), and a checkpoint
is loaded after that. The model summary counts the whole model, though each parameter holds a shard.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.placement import placement_for
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.training_state import move_module_
from hvd_plugins.fabric.lightning_internals import count_summaries_with


class UnitInit(ParallelStrategy):
    """``Trainer.init_module()`` and ``configure_model`` build on the meta device with ``shard="parameters"``
    (as DeepSpeed's stage 3 builds partitioned); elsewhere as Lightning builds."""

    config: HorovodConfig
    gradient_sync: GradientSync | None

    @override
    def setup_environment(self) -> None:
        """The Trainer's model summary told to count each parameter whole (``count_summaries_with``): under
        ``shard="parameters"`` a parameter holds this worker's shard when the summary is made, after setup."""
        super().setup_environment()
        if self.lightning_module is not None:
            count_summaries_with(self.lightning_module.trainer, self._whole_numel)

    def _whole_numel(self, parameter: torch.nn.Parameter) -> int:
        return parameter.numel() if self.gradient_sync is None else self.gradient_sync.whole_numel(parameter)

    @override
    def model_to_device(self) -> None:
        """What is real goes to the device; what is on the meta device waits for setup to make it real there."""
        assert self.model is not None
        move_module_(self.model, self.root_device)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """With ``shard="parameters"`` on the meta device, unless ``empty_init=False`` asks for the whole model:
        ``Trainer.init_module()`` and ``configure_model`` (which Lightning runs in here) alike."""
        if not placement_for(self.config).builds_on_meta(empty_init):
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """With ``shard="parameters"`` the weights are loaded into the units once they exist, one unit at a time."""
        return placement_for(self.config).restores_after_setup
