"""What a Ray launch asks of the cluster, checked before any actor starts: each worker's resources, how many
workers, how they are placed, and for an elastic job the range of workers it may run with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEFAULT_ELASTIC_TIMEOUT_S = 600.0
"""As ``horovodrun --elastic-timeout``: how long an elastic job waits for enough workers before it fails."""


@dataclass(frozen=True)
class ElasticRange:
    """How many workers an elastic job may run with, and how long and how often it may wait for them
    (``horovodrun``'s ``--min-np``, ``--max-np``, ``--elastic-timeout`` and ``--reset-limit``)."""

    min_workers: int = 1
    max_workers: int | None = None  # None: every slot the cluster's nodes offer
    timeout_s: float = DEFAULT_ELASTIC_TIMEOUT_S
    reset_limit: int | None = None
    grows: bool = True
    """Whether workers may join: not into a Fabric loop (``ElasticLoop``), whose joiners' setup would wait on
    survivors that set up long ago."""

    def __post_init__(self) -> None:
        if not _is_count(self.min_workers):
            raise ValueError(f"min_workers={self.min_workers!r}: give an int of at least 1")
        if self.max_workers is not None and (not _is_count(self.max_workers) or self.max_workers < self.min_workers):
            raise ValueError(
                f"max_workers={self.max_workers!r}: give None (every slot the cluster offers) or an int of at least "
                f"min_workers={self.min_workers}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"elastic_timeout_s={self.timeout_s!r}: give a positive number of seconds")
        if self.reset_limit is not None and (not isinstance(self.reset_limit, int) or self.reset_limit < 0):
            raise ValueError(f"reset_limit={self.reset_limit!r}: give None (no limit) or an int of at least 0")

    def admits(self, num_workers: int) -> None:
        """The workers a job starts with must lie in the range."""
        if num_workers < self.min_workers or (self.max_workers is not None and num_workers > self.max_workers):
            most = "no limit" if self.max_workers is None else self.max_workers
            raise ValueError(
                f"num_workers={num_workers} (the workers to start with) must lie between min_workers="
                f"{self.min_workers} and max_workers={most}"
            )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class RayWorkerSpec:
    """What each of ``num_workers`` actors asks of the cluster (ray_lightning's argument names)."""

    num_workers: int
    num_cpus_per_worker: float = 1.0
    use_gpu: bool = False
    resources_per_worker: Mapping[str, float] = field(default_factory=dict)
    placement: str = "PACK"
    placement_timeout_s: float = 60.0
    elastic: ElasticRange | None = None  # None: a fixed number of workers

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers!r}: give the number of workers, an int of at least 1")
        if self.num_cpus_per_worker < 0:
            raise ValueError(f"num_cpus_per_worker={self.num_cpus_per_worker!r}: give 0 or more CPUs per worker")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r}: choose one of {list(PLACEMENTS)}")
        if self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s={self.placement_timeout_s!r}: give a positive number of seconds")
        for key, value in self.resources_per_worker.items():
            if key in ("CPU", "GPU"):
                raise ValueError(
                    f"resources_per_worker={dict(self.resources_per_worker)!r} names {key!r}: give CPUs with "
                    "num_cpus_per_worker and a GPU with use_gpu=True"
                )
            if value < 0:
                raise ValueError(f"resources_per_worker[{key!r}]={value!r}: give 0 or more")
        if self.elastic is not None:
            self.elastic.admits(self.num_workers)
            if self.placement != "PACK":
                raise ValueError(
                    f"placement={self.placement!r} places a fixed number of workers; an elastic job fills each Ray "
                    "node's slots in turn, as horovodrun's host discovery does: leave placement out"
                )
        if not self.bundle():
            raise ValueError(
                "num_cpus_per_worker=0 with no GPU and no other resource: each worker must reserve something for "
                "Ray to place it (num_cpus_per_worker > 0, use_gpu=True, or resources_per_worker)"
            )

    def bundle(self) -> dict[str, float]:
        """The resources of one worker, as a placement group bundle."""
        wanted = {"CPU": float(self.num_cpus_per_worker), **{k: float(v) for k, v in self.resources_per_worker.items()}}
        if self.use_gpu:
            wanted["GPU"] = 1.0
        return {key: value for key, value in wanted.items() if value > 0}


def refuse_what_the_cluster_lacks(spec: RayWorkerSpec, total: Mapping[str, float]) -> None:
    """Before any actor starts: the cluster's total resources must hold every worker's bundle (an elastic job's
    only need a GPU where it asks for one: it waits for the nodes)."""
    for key, each in spec.bundle().items():
        needed, has = each * spec.num_workers, float(total.get(key, 0.0))
        if key == "GPU" and has == 0:
            raise ValueError("use_gpu=True, but the Ray cluster has no GPU: use use_gpu=False, or add GPU nodes")
        if needed <= has or spec.elastic is not None:  # an elastic job waits for nodes, up to elastic_timeout_s
            continue
        raise ValueError(
            f"num_workers={spec.num_workers} with {each:g} {key} each needs {needed:g} {key}, and the Ray cluster has "
            f"{has:g}: use fewer workers or fewer resources per worker, or add nodes"
        )
