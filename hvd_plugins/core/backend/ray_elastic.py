"""An elastic Horovod job on Ray: Horovod's own elastic driver, fed by Ray's view of its nodes.

``horovodrun --host-discovery-script`` runs Horovod's ``ElasticDriver``: it asks a discovery which hosts have how many
slots, gives each slot a rank through the rendezvous, starts a worker for each new slot, blacklists a host whose
worker failed, and tells rank 0 when hosts come or go, so the workers reset at their next commit. Here the same
driver runs in Ray's driver process: the hosts are the cluster's live Ray nodes (``ray.nodes()``), a node's slots
are how many workers' resources it holds, and a worker is an actor pinned to its node. A node that leaves takes its
actors with it (their peers reset without them); a node that joins gets actors, which take the last commit from
rank 0. The workers' side is the elastic fit ``horovodrun`` drives (``HOROVOD_ELASTIC=1``), unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hvd_plugins.core.backend.ray_spec import ElasticRange, RayWorkerSpec
from hvd_plugins.core.backend.ray_workers import (
    HorovodActor,
    WorkerGroup,
    connect,
    import_ray,
    stop_rendezvous,
    worker_environment,
)

POLL_SECONDS = 0.2
"""How often a running worker's thread checks whether the driver stopped or its node left."""


def slots_on(resources: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many workers of ``bundle`` a node of ``resources`` (its totals) holds."""
    return min(int(float(resources.get(key, 0.0)) // each) for key, each in bundle.items())


def host_name(node_id: str) -> str:
    """The Horovod host name of a Ray node: stable while the node lives, distinct across nodes (one machine may
    run several, at one address)."""
    return f"ray-{node_id[:16]}"


def ray_node_slots(bundle: Mapping[str, float]) -> tuple[dict[str, int], dict[str, str]]:
    """The live Ray nodes that hold at least one worker: Horovod host name -> slots, and host name -> node id."""
    ray = import_ray()
    slots: dict[str, int] = {}
    node_ids: dict[str, str] = {}
    for node in ray.nodes():
        count = slots_on(node.get("Resources", {}), bundle) if node.get("Alive") else 0
        if count > 0:
            name = host_name(node["NodeID"])
            slots[name], node_ids[name] = count, node["NodeID"]
    return slots, node_ids


def _discovery(bundle: Mapping[str, float]) -> Any:
    """Horovod's host discovery over the live Ray nodes (its ``HostDiscovery``, as a host discovery script is)."""
    from horovod.runner.elastic.discovery import HostDiscovery

    class RayNodeDiscovery(HostDiscovery):
        def __init__(self) -> None:
            super().__init__()
            self.node_ids: dict[str, str] = {}
            self.only: set[str] | None = None  # once set, the hosts it may still offer (a job that never grows)
            self._lock = threading.Lock()

        def find_available_hosts_and_slots(self) -> dict[str, int]:
            slots, node_ids = ray_node_slots(bundle)
            with self._lock:
                self.node_ids.update(node_ids)
                only = self.only
            return slots if only is None else {host: count for host, count in slots.items() if host in only}

        def keep_only(self, hosts: set[str]) -> None:
            with self._lock:
                self.only = set(hosts)

        def node_of(self, host: str) -> str:
            with self._lock:
                return self.node_ids[host]

    return RayNodeDiscovery()


@dataclass(frozen=True)
class WorkerFailure:
    """A worker that failed: in which of the driver's rendezvous (worlds), when, where, in which rank, and what it
    raised."""

    world: int
    at: float
    host: str
    rank: int
    error: BaseException


@dataclass
class ElasticRayWorkers(WorkerGroup):
    """An elastic job's workers on the connected Ray cluster (``ray.init()`` is called when none is): it waits for
    ``spec.num_workers`` slots, then runs as many workers as the live nodes hold, within ``spec.elastic``."""

    spec: RayWorkerSpec
    _driver: Any = None
    _server: Any = None
    _discovery: Any = None
    _address: str = ""
    _port: int = 0
    _payload: Any = None
    _actors: set[Any] = field(default_factory=set)
    _results: dict[int, Any] = field(default_factory=dict)  # by the rank each worker ended with
    _failures: list[WorkerFailure] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock)  # a signal's shutdown may come while held
    _stopped: bool = False  # shut down while running: the launcher's kill (a signal)

    @property
    def range(self) -> ElasticRange:
        assert self.spec.elastic is not None
        return self.spec.elastic

    def _start(self) -> None:
        """Horovod's elastic driver and rendezvous running here, once the cluster offers ``spec.num_workers`` slots
        (within ``elastic_timeout_s``)."""
        ray = connect(self.spec)
        from horovod.runner.elastic.driver import ElasticDriver
        from horovod.runner.elastic.rendezvous import create_rendezvous_handler
        from horovod.runner.http.http_server import RendezvousServer

        self._discovery = _discovery(self.spec.bundle())
        self._server = RendezvousServer(verbose=0)
        self._driver = ElasticDriver(
            self._server,
            self._discovery,
            self.range.min_workers,
            self.range.max_workers,
            timeout=self.range.timeout_s,
            reset_limit=self.range.reset_limit,
        )
        self._address = ray.util.get_node_ip_address()
        self._port = self._server.start(create_rendezvous_handler(self._driver))
        try:
            self._driver.wait_for_available_slots(self.spec.num_workers)
        except self._driver.WAIT_ENDED as waited:
            slots, _ = ray_node_slots(self.spec.bundle())
            held = ", ".join(f"{host}: {count}" for host, count in slots.items()) or "none"
            raise RuntimeError(
                f"num_workers={self.spec.num_workers} workers of {self.spec.bundle()} could not start within "
                f"elastic_timeout_s={self.range.timeout_s:g}: the live Ray nodes hold {sum(slots.values())} such "
                f"workers ({held}); start with fewer (num_workers), or add nodes"
            ) from waited

    def run(self, payload: Callable[[], Any]) -> list[Any]:
        """``payload()`` in every worker, elastically; the results of the workers of the last world, by the rank
        each ended with. Fails, naming the first worker that failed, when the job cannot go on (fewer than
        ``min_workers`` left for ``elastic_timeout_s``, every node blacklisted, ``reset_limit`` reached)."""
        ray = import_ray()
        driver = self._driver
        self._payload = ray.put(payload)
        driver.start(self.spec.num_workers, self._run_slot)
        if not self.range.grows:  # the first world's nodes only, from now on: it shrinks, it never grows
            self._discovery.keep_only(set(driver.host_assignments))
        outcome = driver.get_results()
        driver.stop()
        if self._stopped:
            raise RuntimeError("the elastic job was stopped (a signal): every worker was stopped")
        failed = any(code != 0 for code, _ in outcome.worker_results.values())
        if outcome.error_message is not None or failed or not self._results:
            self._raise_failure(outcome.error_message)
        size = max(self._results) + 1
        return [self._results.get(rank) for rank in range(size)]

    def _raise_failure(self, driver_said: str | None) -> None:
        with self._lock:
            last_world = max((failure.world for failure in self._failures), default=0)
            failures = sorted((f for f in self._failures if f.world == last_world), key=lambda failure: failure.at)
        said = f"the elastic job ended: {driver_said}" if driver_said else "the elastic job ended with no worker left"
        if not failures:
            raise RuntimeError(said)
        first = failures[0]
        raise RuntimeError(
            f"{said}; the first worker to fail was rank {first.rank} on Ray node {first.host} "
            f"({type(first.error).__name__}):\n{first.error}"
        ) from first.error

    def _run_slot(self, slot: Any, events: Sequence[threading.Event]) -> tuple[int, float]:
        """Horovod's driver calls this, in a thread of its own, for each slot it fills: an actor on the slot's node
        runs the payload until it returns (0), fails, or its node leaves or the driver stops (1)."""
        ray = import_ray()
        driver, actor = self._driver, None
        try:
            actor = self._new_actor(self._discovery.node_of(slot.hostname))
            _, _, interface, gpus = ray.get(actor.where.remote(), timeout=self.spec.placement_timeout_s)
            environment = self._environment(slot, interface, gpus)
            future = actor.run_ranked.remote(environment, self._payload)
            while True:
                done, _ = ray.wait([future], timeout=POLL_SECONDS)
                if done:
                    rank, result = ray.get(future)
                    with self._lock:
                        self._results[rank] = result
                    return 0, time.time()
                if any(event.is_set() for event in events):
                    return 1, time.time()
        except Exception as error:
            self._record_failure(driver, slot, error)
            return 1, time.time()
        finally:
            if actor is not None:
                self._stop_actor(actor)

    def _record_failure(self, driver: Any, slot: Any, error: Exception) -> None:
        """The failure, with the rank its worker held last (ranks change at every reset) and the world it was in."""
        with contextlib.suppress(Exception):
            held = driver.get_slot_info(slot.hostname, slot.local_rank).rank
            world = driver._worker_registry.last_rendezvous()  # horovodrun names a failure of the last world too
            failure = WorkerFailure(world, time.time(), slot.hostname, held if held >= 0 else slot.rank, error)
            with self._lock:
                self._failures.append(failure)

    def _new_actor(self, node_id: str) -> Any:
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        bundle = self.spec.bundle()
        actor = (
            ray.remote(HorovodActor)
            .options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote()
        )
        with self._lock:
            self._actors.add(actor)
        return actor

    def _environment(self, slot: Any, interface: str | None, gpus: list[str]) -> dict[str, str]:
        """``horovodrun``'s variables for an elastic worker: the slot it starts in (later ones come from the
        rendezvous), and what it says while a reset waits. A GPU worker sees only the GPU Ray gave it: the node's
        other workers come and go, each with its own."""
        environment = worker_environment(slot, self._address, self._port, interface)
        environment.update(
            HOROVOD_ELASTIC="1",
            HOROVOD_ELASTIC_MIN_NP=str(self.range.min_workers),
            HOROVOD_ELASTIC_TIMEOUT=f"{self.range.timeout_s:g}",
            HVD_PLUGINS_ELASTIC_LAUNCHER="ray",
        )
        if gpus:
            environment["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return environment

    def _stop_actor(self, actor: Any) -> None:
        ray = import_ray()
        with self._lock:
            self._actors.discard(actor)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

    def shutdown(self) -> None:
        """The driver stopped (its discovery thread ends), every actor killed, the rendezvous closed; a worker's
        request the driver held at its barrier (a reset under way) is released."""
        driver = self._driver
        try:
            if driver is not None and not driver.finished():
                self._stopped = True
                with contextlib.suppress(Exception):
                    driver.stop()
            if driver is not None:
                barrier = getattr(getattr(driver, "_worker_registry", None), "_barrier", None)
                if barrier is not None:
                    barrier.abort()
        finally:
            with self._lock:
                actors, self._actors = list(self._actors), set()
            for actor in actors:
                self._stop_actor(actor)
            server, self._server = self._server, None
            if server is not None:
                stop_rendezvous(server)
