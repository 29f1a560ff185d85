"""How many workers a plain ``python train.py`` starts, and the errors that name what was set."""

from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch

from hvd_plugins import HorovodEnvironment
from hvd_plugins.core.backend.runner import local_launch_size

plain_process = pytest.mark.skipif(
    HorovodEnvironment.detect() or hvd.is_initialized(), reason="needs a plain process without Horovod running"
)


@plain_process
def test_what_a_plain_process_launches() -> None:
    cpu = torch.device("cpu")
    assert local_launch_size([cpu], num_nodes=1) == 0  # one device: one process, no launcher
    assert local_launch_size([cpu] * 4, num_nodes=1) == 4
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        local_launch_size([torch.device("cuda", 1), torch.device("cuda", 3)], num_nodes=1)
    with pytest.raises(ValueError, match=r"^Fabric\(num_nodes=2\) needs horovodrun"):  # errors name what was set
        local_launch_size([cpu] * 2, num_nodes=2, front="Fabric")
    environment = HorovodEnvironment(front="Fabric")
    environment.launch_size = 2  # two workers of its own launch, not started yet
    with pytest.raises(ValueError, match=r"^Fabric\(devices=3\) disagrees with the Horovod job, which runs 2 "):
        environment.validate_settings(num_devices=3, num_nodes=1)
