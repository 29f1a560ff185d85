"""``HorovodRayStrategy``: the Trainer's Horovod workers run as actors on a Ray cluster.

``python train.py`` on a Ray cluster's head (or after ``ray.init(address=...)``; a local cluster is started when
none is connected) runs ``num_workers`` Horovod workers as Ray actors for each ``fit``, ``validate``, ``test`` and
``predict``, with ray_lightning's argument names. Every ``HorovodStrategy`` setting applies inside the workers.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hvd_plugins.fabric.strategies.ray import OnRay
from hvd_plugins.pytorch.elastic import ElasticFit
from hvd_plugins.pytorch.strategies.horovod import HorovodStrategy
from hvd_plugins.pytorch.strategies.launchers.ray import RayLauncher


class HorovodRayStrategy(OnRay, HorovodStrategy):
    """``HorovodStrategy`` whose workers are Ray actors, placed by a placement group (``placement``: ``"PACK"`` by
    default, ``"SPREAD"`` to put them on as many nodes as it can), ranked by their nodes (local and cross ranks are
    the real nodes'), with Horovod's rendezvous in the driver.

    Args:
        num_workers: how many Horovod workers (actors) to run.
        num_cpus_per_worker: CPUs each actor reserves.
        use_gpu: each actor reserves one GPU and trains on it (NCCL); the Trainer must train on GPUs too
            (``accelerator="gpu"``), and on the CPU without it.
        resources_per_worker: other Ray resources each actor reserves, by name.
        placement: the placement group's strategy: ``"PACK"``, ``"SPREAD"``, ``"STRICT_PACK"``, ``"STRICT_SPREAD"``.
        placement_timeout_s: how long to wait for the cluster to place every worker before saying it cannot.
        elastic: absorb workers in place, inside the same ``fit``, as Ray's nodes leave or join (docs/elastic.rst):
            each live node runs as many workers as its resources hold; ``num_workers`` is how many to start with.
        min_workers: an elastic fit goes on with at least this many workers (and waits for them).
        max_workers: an elastic fit grows to at most this many workers (None: every slot the nodes offer).
        elastic_timeout_s: how long an elastic fit waits for ``min_workers`` before it fails.
        reset_limit: how many elastic resets a fit may go through before it fails (None: no limit).
        **horovod_settings: any argument of ``HorovodStrategy`` (``compression``, ``sync``, ``shard``, ...);
            ``auto_requeue`` is off unless given (the Slurm job a Ray cluster may run in is not this fit's).
    """

    launcher_class = RayLauncher
    elastic_grows = True

    def _take_elastic(self) -> None:
        """The workers run each fit elastically, as under an elastic ``horovodrun``."""
        self.elastic = ElasticFit(self.config.commit_every_n_steps)

    horovod_defaults: ClassVar[dict[str, Any]] = {"auto_requeue": False}  # a Slurm job around Ray is not the fit's
