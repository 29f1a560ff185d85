"""Horovod's workers as Ray actors, started the way ``horovodrun`` starts them on hosts.

A placement group places the actors (PACK by default, SPREAD on request); the actors are grouped by the Ray node
they landed on, so ranks run contiguously per node and local and cross ranks are the real nodes'. This process
(Ray's driver) runs Horovod's rendezvous, and each actor is given the variables ``horovodrun`` gives a worker
before it starts Horovod. A failed or lost actor ends the job: the others are killed and the error names its rank
and node. The driver needs Ray and Horovod's runner (the rendezvous); the actors import what they train with.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hvd_plugins.core.backend.ray_spec import RayWorkerSpec, refuse_what_the_cluster_lacks

FORWARDED_PREFIXES = ("HOROVOD_", "NCCL_", "HVD_PLUGINS_")
"""The driver's variables every actor gets too, as horovodrun forwards them (actors inherit the raylet's)."""
SETTLE_SECONDS = 2.0
"""After a worker fails, how long to wait for the others' outcomes before naming the one that failed first."""
RAY_MISSING = "HorovodRayStrategy needs Ray: pip install 'hvd_plugins[ray]' (or pip install ray)"


def import_ray() -> ModuleType:
    """Ray, or an error that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(RAY_MISSING) from error
    return ray


def connect(spec: RayWorkerSpec) -> ModuleType:
    """Ray, connected to a cluster (``ray.init()`` when none is) whose resources hold ``spec``'s workers."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init()
    refuse_what_the_cluster_lacks(spec, ray.cluster_resources())
    return ray


class WorkerGroup(ABC):
    """Workers that ``start()`` brings up, or leaves nothing of behind: what failed is shut down, then raised."""

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    @abstractmethod
    def _start(self) -> None:
        """Bring the workers up (``start`` cleans up after a failure)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and what serves them; safe to call more than once."""


def host_plan(nodes: Sequence[str]) -> tuple[list[int], list[Any]]:
    """For the node each actor landed on (by actor): the actors ordered so that each node's run contiguously, and
    Horovod's slots (rank, local and cross ranks) for them in that order, one host per node."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    order: dict[str, list[int]] = {}
    for actor, node in enumerate(nodes):
        order.setdefault(node, []).append(actor)
    names = {node: f"ray-node-{index}" for index, node in enumerate(order)}
    hosts = ",".join(f"{names[node]}:{len(actors)}" for node, actors in order.items())
    slots = get_host_assignments(parse_hosts(hosts), len(nodes))
    return [actor for actors in order.values() for actor in actors], slots


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address`` (Gloo binds there)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return None


class HorovodActor:
    """One worker: where it runs, and a function run with Horovod's variables set."""

    def where(self) -> tuple[str, str, str | None, list[str]]:
        """The Ray node, its address, the interface that holds it, and the GPUs Ray gave this actor."""
        import ray

        address = ray.util.get_node_ip_address()
        gpus = [str(gpu) for gpu in ray.get_gpu_ids()]
        return ray.get_runtime_context().get_node_id(), address, interface_of(address), gpus

    def run(self, environment: Mapping[str, str], payload: Callable[[], Any]) -> Any:
        os.environ.update(environment)
        return payload()

    def run_ranked(self, environment: Mapping[str, str], payload: Callable[[], Any]) -> tuple[int, Any]:
        """``run``, with the Horovod rank this worker ended with (an elastic reset renumbers the workers)."""
        result = self.run(environment, payload)
        return current_rank(), result


def current_rank() -> int:
    """This worker's Horovod rank now: Horovod's own once it runs (elastic resets renumber the workers), else the
    one the launcher gave it."""
    from hvd_plugins.core.backend.module import horovod_torch

    hvd = horovod_torch()
    return int(hvd.rank()) if hvd.is_initialized() else int(os.environ["HOROVOD_RANK"])


@dataclass
class RayWorkers(WorkerGroup):
    """``spec.num_workers`` actors on the connected Ray cluster (``ray.init()`` is called when none is), ranked by
    node, with Horovod's rendezvous in this process."""

    spec: RayWorkerSpec
    actors: list[Any] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)  # by rank: the Ray node id
    environments: list[dict[str, str]] = field(default_factory=list)  # by rank
    _group: Any = None
    _server: Any = None

    def _start(self) -> None:
        """The actors placed, ranked and given their variables."""
        ray = connect(self.spec)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._group = placement_group([self.spec.bundle()] * self.spec.num_workers, strategy=self.spec.placement)
        ready, _ = ray.wait([self._group.ready()], timeout=self.spec.placement_timeout_s)
        if not ready:
            raise RuntimeError(
                f"{self.spec.num_workers} workers of {self.spec.bundle()} could not be placed ({self.spec.placement}) "
                f"within {self.spec.placement_timeout_s:g} s; the cluster has {ray.available_resources()} free: use "
                "fewer workers, or wait for the cluster to free or add resources"
            )
        bundle = self.spec.bundle()
        actor_class = ray.remote(HorovodActor)
        actors = [
            actor_class.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index),
            ).remote()
            for index in range(self.spec.num_workers)
        ]
        self.actors = actors
        where = ray.get([actor.where.remote() for actor in actors])
        order, slots = host_plan([node for node, _, _, _ in where])
        self.actors = [actors[index] for index in order]
        self.nodes = [f"{where[index][0][:12]} ({where[index][1]})" for index in order]
        self._server = rendezvous_server(slots)
        address, port = ray.util.get_node_ip_address(), self._server.port
        node_gpus: dict[str, list[str]] = {}
        for index in order:  # each node's GPUs in its workers' local rank order: local rank r drives cuda:r
            node_gpus.setdefault(where[index][0], []).extend(where[index][3])
        self.environments = []
        for index, slot in zip(order, slots, strict=True):
            environment = worker_environment(slot, address, port, where[index][2])
            if node_gpus[where[index][0]]:
                environment["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus[where[index][0]])
            self.environments.append(environment)

    def run(self, payload: Callable[[], Any]) -> list[Any]:
        """``payload()`` in every actor, Horovod's variables set; each one's result, by rank. The first that fails
        (an exception, or its actor or node lost) ends the others and is raised, naming its rank and node."""
        ray = import_ray()
        shared = ray.put(payload)
        futures = [actor.run.remote(env, shared) for actor, env in zip(self.actors, self.environments, strict=True)]
        rank_of = {future: rank for rank, future in enumerate(futures)}
        results: dict[int, Any] = {}
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[rank_of[done[0]]] = ray.get(done[0])
            except Exception:
                settled, _ = ray.wait(pending, num_returns=len(pending), timeout=SETTLE_SECONDS)
                self._raise_first_failure([done[0], *settled], rank_of)
        return [results[rank] for rank in range(len(futures))]

    def _raise_first_failure(self, finished: Sequence[Any], rank_of: Mapping[Any, int]) -> None:
        """Every other worker stopped, then the failure named: a worker that died before one whose Horovod broke
        because a peer left (each names the rank and node that failed)."""
        ray = import_ray()
        from ray.exceptions import RayActorError

        failures: list[tuple[int, Exception]] = []
        for future in finished:
            try:
                ray.get(future)
            except Exception as failed:
                failures.append((rank_of[future], failed))
        self.shutdown()
        failures.sort(key=lambda failure: (not isinstance(failure[1], RayActorError), failure[0]))
        rank, first = failures[0]
        others = sorted(other for other, _ in failures[1:])
        also = f"; ranks {others} failed after it" if others else ""
        raise RuntimeError(
            f"the worker of rank {rank} on Ray node {self.nodes[rank]} failed ({type(first).__name__}){also}; every "
            f"other worker was stopped:\n{first}"
        ) from first

    def shutdown(self) -> None:
        """Every actor killed, the placement group removed, the rendezvous stopped: nothing left behind, each
        step taken whatever the one before it raised."""
        ray = import_ray()
        actors, self.actors = self.actors, []
        group, self._group = self._group, None
        server, self._server = self._server, None
        try:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        finally:
            try:
                if group is not None:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(group)
            finally:
                if server is not None:
                    server.stop()


@dataclass
class _Rendezvous:
    server: Any
    port: int

    def stop(self) -> None:
        stop_rendezvous(self.server)


def stop_rendezvous(server: Any) -> None:
    """Horovod's rendezvous server stopped and its socket closed (its ``stop()`` leaves the socket open), without
    waiting for requests still answered; once is enough, twice does no harm."""
    httpd = getattr(server, "_httpd", None)
    if httpd is None:
        return
    server.stop()
    httpd.block_on_close = False  # a request held by an elastic driver's barrier must not hold this
    httpd.server_close()


def rendezvous_server(slots: Sequence[Any]) -> _Rendezvous:
    """Horovod's Gloo rendezvous in this process, for ``slots``."""
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer(verbose=0)
    rendezvous = _Rendezvous(server, server.start())
    try:
        server.init(list(slots))
    except BaseException:
        rendezvous.stop()
        raise
    return rendezvous


def worker_environment(slot: Any, address: str, port: int, interface: str | None) -> dict[str, str]:
    """The variables ``horovodrun --gloo`` gives the worker of ``slot``: the driver's own ``HOROVOD_*``, ``NCCL_*``
    and ``HVD_PLUGINS_*`` (a ``HOROVOD_GLOO_IFACE`` set there wins over the interface found), then the ranks and
    the rendezvous; Gloo (and NCCL's sockets) bound to ``interface``, the one holding the node's Ray address."""
    forwarded = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_PREFIXES)}
    interface = forwarded.get("HOROVOD_GLOO_IFACE") or interface
    environment = {
        **forwarded,
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "60"),
    }
    if interface is not None:
        environment["HOROVOD_GLOO_IFACE"] = interface
        environment.setdefault("NCCL_SOCKET_IFNAME", interface)
    return environment
