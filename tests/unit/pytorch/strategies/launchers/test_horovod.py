"""A plain ``Trainer(devices=N)`` plans its own workers and starts nothing before fit."""

from __future__ import annotations

import horovod.torch as hvd
import pytest
from lightning.pytorch import Trainer

from hvd_plugins import HorovodEnvironment, HorovodStrategy
from hvd_plugins.pytorch.strategies.launchers.horovod import HorovodScriptLauncher

plain_process = pytest.mark.skipif(
    HorovodEnvironment.detect() or hvd.is_initialized(), reason="needs a plain process without Horovod running"
)


@plain_process
def test_a_plain_trainer_with_two_devices_plans_two_workers_and_starts_nothing_until_fit() -> None:
    trainer = Trainer(strategy=HorovodStrategy(), accelerator="cpu", devices=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy.launcher, HorovodScriptLauncher) and strategy.launcher.size == 2
    assert strategy.cluster_environment is not None
    assert not strategy.cluster_environment.creates_processes_externally  # so Lightning uses the launcher
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank) == (2, 0, 0, 0)
    assert not hvd.is_initialized()  # Horovod starts in the launcher, once the workers run
    with pytest.raises(ValueError, match="needs horovodrun"):
        Trainer(strategy=HorovodStrategy(), accelerator="cpu", devices=2, num_nodes=2, logger=False)
