"""Cluster environment read from Horovod: ranks and sizes come from ``hvd``, never guessed.

The one exception is a plain process that will start its workers itself (``launch_size``): until
it has started them and Horovod, it answers as rank 0 of the job it is about to launch.
"""

from __future__ import annotations

import os
from types import ModuleType

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from hvd_plugins.core.backend.launch_env import launched_by_launcher
from hvd_plugins.core.backend.module import horovod_torch


class HorovodEnvironment(ClusterEnvironment):
    """Rank and size queries answered by an initialised Horovod."""

    def __init__(self, front: str = "Trainer") -> None:
        super().__init__()
        self.launch_size = 0
        """Workers this process starts itself (``python train.py`` with ``devices=N``); 0 under a launcher."""
        self.front = front
        """What the user configured ``devices`` and ``num_nodes`` on (``Trainer`` or ``Fabric``), for errors."""

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return self.launch_size == 0  # horovodrun (or mpirun) starts every worker, unless this process does

    def _started(self) -> ModuleType | None:
        """Horovod, or None while this process has yet to start the workers of its own launch."""
        hvd = horovod_torch()
        return None if self.launch_size and not hvd.is_initialized() else hvd

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0"))

    @staticmethod
    @override
    def detect() -> bool:
        """True inside a worker started by horovodrun or an MPI launcher."""
        return launched_by_launcher()

    @override
    def world_size(self) -> int:
        hvd = self._started()
        return self.launch_size if hvd is None else hvd.size()

    @override
    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher

    @override
    def global_rank(self) -> int:
        hvd = self._started()
        return 0 if hvd is None else hvd.rank()

    @override
    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the launcher

    @override
    def local_rank(self) -> int:
        hvd = self._started()
        return 0 if hvd is None else hvd.local_rank()

    @override
    def node_rank(self) -> int:
        hvd = self._started()
        return 0 if hvd is None else hvd.cross_rank()

    def local_size(self) -> int:
        hvd = self._started()
        return self.launch_size if hvd is None else hvd.local_size()

    def num_nodes(self) -> int:
        hvd = self._started()
        return 1 if hvd is None else hvd.cross_size()

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check the Trainer's (or Fabric's) ``devices``/``num_nodes`` against what horovodrun started."""
        local_size, cross_size = self.local_size(), self.num_nodes()
        if num_nodes not in (1, cross_size):
            raise ValueError(
                f"{self.front}(num_nodes={num_nodes}) disagrees with the Horovod job, which runs on "
                f"{cross_size} node(s). Drop num_nodes (the launcher decides) or set it to {cross_size}."
            )
        if num_devices not in (1, local_size):
            raise ValueError(
                f"{self.front}(devices={num_devices}) disagrees with the Horovod job, which runs {local_size} "
                f"worker(s) on this node, one device each. Use devices=1 or devices={local_size}, and "
                "choose the number of workers with `horovodrun -np`."
            )
