"""``HorovodRayStrategy`` for Fabric, and what it shares with the Trainer's: the workers are Ray actors.

``Fabric(strategy=HorovodRayStrategy(num_workers=4))`` then ``fabric.launch(train)``: ``train(fabric)`` runs in
every actor, Horovod started there from the variables the launcher gives each one (ranks follow the Ray nodes),
and ``fabric.launch`` returns rank 0's result in the driver.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any, ClassVar

import torch
from typing_extensions import override

from hvd_plugins.core.backend.ray_spec import DEFAULT_ELASTIC_TIMEOUT_S, ElasticRange, RayWorkerSpec
from hvd_plugins.fabric.lightning_internals import set_launcher
from hvd_plugins.fabric.strategies.horovod import HorovodStrategy
from hvd_plugins.fabric.strategies.launchers.ray import RayFabricLauncher
from hvd_plugins.fabric.strategies.shared import HorovodStrategyShared


class OnRay(HorovodStrategyShared):
    """Placed before a face's ``HorovodStrategy``: the driver starts no Horovod (the actors do, once launched),
    and each actor's rank-zero output follows its Horovod rank."""

    ray_workers: RayWorkerSpec
    launcher_class: type[RayFabricLauncher]
    """The face's launcher: Fabric's, or the Trainer's (which also takes the Trainer)."""
    horovod_defaults: ClassVar[dict[str, Any]] = {}
    """``HorovodStrategy`` settings this face changes unless given."""
    elastic_grows: ClassVar[bool] = False
    """Whether an elastic job of this face takes in workers as nodes join (the Trainer's fit does; a Fabric loop,
    whose new workers would set up while the others wait in ``ElasticLoop``, only loses workers)."""

    def __init__(
        self,
        num_workers: int = 1,
        num_cpus_per_worker: float = 1.0,
        use_gpu: bool = False,
        resources_per_worker: Mapping[str, float] | None = None,
        placement: str = "PACK",
        placement_timeout_s: float = 60.0,
        elastic: bool = False,
        min_workers: int = 1,
        max_workers: int | None = None,
        elastic_timeout_s: float = DEFAULT_ELASTIC_TIMEOUT_S,
        reset_limit: int | None = None,
        **horovod_settings: Any,
    ) -> None:
        if elastic not in (True, False):
            raise ValueError(f"elastic={elastic!r}: give True (workers come and go with Ray's nodes) or False")
        elastic_range = (
            ElasticRange(min_workers, max_workers, elastic_timeout_s, reset_limit, self.elastic_grows)
            if elastic
            else None
        )
        self.ray_workers = RayWorkerSpec(
            num_workers,
            num_cpus_per_worker,
            use_gpu,
            dict(resources_per_worker or {}),
            placement,
            placement_timeout_s,
            elastic_range,
        )  # checked before anything starts
        super().__init__(**{**self.horovod_defaults, **horovod_settings})
        if elastic_range is not None:
            self._take_elastic()

    def _take_elastic(self) -> None:
        """The face's elastic state, for the workers to run with (they start with ``HOROVOD_ELASTIC=1``); Fabric
        keeps none: its loops are elastic through ``ElasticLoop``."""

    def _configure_launcher(self) -> None:
        """Lightning's hook: the face's Ray launcher, once the devices are checked against ``use_gpu``."""
        self._refuse_devices_other_than_asked()
        set_launcher(self, self.launcher_class(self.ray_workers, self._follow_rank))

    @override
    def _plan_launch(self) -> None:
        self._environment.launch_size = self.ray_workers.num_workers

    @override
    def _start_worker(self) -> ModuleType:
        hvd = super()._start_worker()
        self._follow_rank(hvd.rank())
        return hvd

    @property
    def root_device(self) -> torch.device:
        """An elastic GPU worker sees only the GPU Ray gave it (the node's other workers come and go, each with
        its own), as ``cuda:0``."""
        device = super().root_device
        if device.type == "cuda" and self.ray_workers.elastic is not None:
            return torch.device("cuda", 0)
        return device

    def _refuse_devices_other_than_asked(self) -> None:
        """The workers train on the devices the driver's Trainer (or Fabric) chose, which ``use_gpu`` must match:
        a GPU reserved and unused, or used and not reserved, is refused before any actor starts."""
        devices = self.parallel_devices or []
        on_gpu = bool(devices) and devices[0].type == "cuda"
        if self.ray_workers.use_gpu and not on_gpu:
            raise ValueError(
                f"use_gpu=True reserves a GPU for each worker, but the {self._environment.front} trains on the CPU: "
                "pass accelerator='gpu' (the driver must see a GPU), or use_gpu=False"
            )
        if on_gpu and not self.ray_workers.use_gpu:
            raise ValueError(
                f"the {self._environment.front} trains on GPUs, but use_gpu=False reserves none for the workers: pass "
                "use_gpu=True, or accelerator='cpu'"
            )


class HorovodRayStrategy(OnRay, HorovodStrategy):
    """Fabric's ``HorovodStrategy`` whose workers are Ray actors; the arguments are the Trainer's
    ``hvd_plugins.ray.HorovodRayStrategy``'s (``num_workers``, ``num_cpus_per_worker``, ``use_gpu``,
    ``resources_per_worker``, ``placement``, ``placement_timeout_s``, and ``elastic``, ``min_workers``,
    ``max_workers``, ``elastic_timeout_s``, ``reset_limit``), then any of ``HorovodStrategy``. Elastic, a loop run
    by ``ElasticLoop`` loses workers as nodes leave and takes in none."""

    launcher_class = RayFabricLauncher
