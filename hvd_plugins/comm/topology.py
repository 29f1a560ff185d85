"""Which workers share a node, learned from Horovod and turned into process sets.

Horovod numbers nodes by ``cross_rank`` and workers inside a node by ``local_rank``; global
ranks need not be contiguous per node, so the layout is gathered from every worker rather
than assumed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from hvd_plugins._horovod import horovod_torch

DYNAMIC_PROCESS_SETS_ENV = "HOROVOD_DYNAMIC_PROCESS_SETS"
RESTART_SETTLE_SECONDS = 2.0
"""Pause between the shutdown and the restart with process sets (see start_horovod_with_node_sets)."""


@dataclass(frozen=True)
class Topology:
    """The layout of the job as seen from one worker.

    ``nodes[n][i]`` is the global rank of local rank ``i`` on node ``n``.
    """

    rank: int
    nodes: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return sum(len(node) for node in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def node_index(self) -> int:
        return next(n for n, node in enumerate(self.nodes) if self.rank in node)

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node_index].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node_index])

    @property
    def equal_nodes(self) -> bool:
        return len({len(node) for node in self.nodes}) == 1

    def node_ranks(self, node: int) -> tuple[int, ...]:
        return self.nodes[node]

    def cross_ranks(self, local_rank: int) -> tuple[int, ...]:
        """Global ranks holding ``local_rank`` on every node: one worker per node."""
        return tuple(node[local_rank] for node in self.nodes)

    def require_equal_nodes(self, feature: str) -> None:
        """Raise a clear error when nodes run different numbers of workers."""
        if not self.equal_nodes:
            sizes = {n: len(node) for n, node in enumerate(self.nodes)}
            raise ValueError(
                f"{feature} needs the same number of workers on every node, but workers per node are "
                f"{sizes}. Launch e.g. `horovodrun -np 4 -H host1:2,host2:2`."
            )

    @staticmethod
    def from_pairs(rank: int, pairs: list[tuple[int, int]]) -> Topology:
        """Build from ``pairs[r] = (cross_rank, local_rank)`` of every global rank ``r``."""
        by_node: dict[int, dict[int, int]] = {}
        for global_rank, (node, local) in enumerate(pairs):
            by_node.setdefault(node, {})[local] = global_rank
        nodes = tuple(tuple(ranks[i] for i in sorted(ranks)) for _, ranks in sorted(by_node.items()))
        return Topology(rank=rank, nodes=nodes)


def discover_topology() -> Topology:
    """Gather ``(cross_rank, local_rank)`` from every worker (one small allgather)."""
    hvd = horovod_torch()
    mine = torch.tensor([[hvd.cross_rank(), hvd.local_rank()]], dtype=torch.int64)
    everyone = hvd.allgather(mine, name="hvd_plugins.topology")
    return Topology.from_pairs(hvd.rank(), [(int(a), int(b)) for a, b in everyone.tolist()])


def node_process_sets(topology: Topology) -> list[tuple[int, ...]]:
    """The process sets a node-aware sync needs beyond the global one, in an order equal on every rank.

    A node's set is needed only when there are several nodes and several workers per node; with
    one node the node set is the global set, and with one worker per node the cross-node set is.
    """
    if topology.num_nodes == 1 or not topology.equal_nodes or topology.local_size == 1:
        return []
    cross = [topology.cross_ranks(i) for i in range(topology.local_size)]
    return [*topology.nodes, *cross]


@dataclass(frozen=True)
class NodeGroups:
    """The process sets one worker uses: its node, and its peers on the other nodes.

    ``None`` where the sync needs no collective: a node of one worker has no ``local`` set and a
    single node has no ``cross`` set. A set that spans every worker is Horovod's global set.
    """

    topology: Topology
    local: Any  # hvd.ProcessSet of this worker's node
    cross: Any  # hvd.ProcessSet of the workers with this local rank, one per node


_REGISTERED: dict[tuple[int, ...], Any] = {}
"""Process sets this package created, by their ranks; emptied whenever Horovod restarts."""
_STARTED: list[Topology] = []
"""The layout gathered by ``start_horovod_with_node_sets`` for the running Horovod (at most one)."""


def forget_process_sets() -> None:
    """Drop the sets of a Horovod run that is being shut down (they die with it)."""
    _REGISTERED.clear()
    _STARTED.clear()


def start_horovod_with_node_sets(hvd: Any) -> Topology:
    """Make Horovod run with the process sets a node-aware sync needs, as STATIC sets.

    Every rank calls this at the same point. Horovod is started plainly when it is not running
    (or the user's own ``hvd.init()`` is kept), the layout is gathered from every worker (one
    small allgather), and only when sets are needed (several nodes with several workers each)
    is Horovod shut down and started again with them. Deciding from the gathered layout rather
    than from each rank's launcher variables keeps the decision equal on every rank: with unequal
    slots per host (``-H a:5,b:5,c:5,d:1,e:4``) a per-rank check of ``HOROVOD_LOCAL_SIZE`` and
    ``HOROVOD_CROSS_SIZE`` passes on some ranks and fails on others, and ranks that pass
    different sets to ``hvd.init`` hang. Dynamic process sets are never turned on here.

    Why, measured on this project's 2-core machine (emulated nodes on loopback, other jobs
    running: medians of 5 jobs, spreads overlap; ``benchmarks/transport.py``,
    docs/benchmarks/transport.txt). Two-level allreduce of 1k / 1M float32 on 2 nodes x 2:
    dynamic sets 181 / 279 ms, static sets 117-123 / 213-265 ms, no sets (legs as global
    alltoalls with partner-only splits) 105 / 210 ms; no job of any transport failed. On 2 nodes
    x 1, where no set beyond the global one is needed, dynamic mode alone made the same
    allreduce 40 / 53 ms against 20 / 35 ms without it. Per leg (1M), Horovod's reducescatter
    on a node's set took 132-169 ms against 67 ms as an alltoall, while the cross-node
    allreduce (40-46 ms) and the node allgather (22-35 ms) were faster on static sets than as
    alltoalls (53 / 51 ms); ``comm.hierarchical`` uses the faster one for each leg. Static sets
    also keep DASO's node-local collectives, and dynamic mode's extra global negotiation of
    every cycle is gone. Costs: one plain start plus, when sets are needed, a restart (1.4 s
    here, against 0.6 s for a dynamic start).
    """
    if not hvd.is_initialized():
        forget_process_sets()
        hvd.init()
    if _STARTED:  # idempotent: no second gather in the same Horovod run
        return _STARTED[0]
    topology = discover_topology()
    wanted = node_process_sets(topology)
    if os.environ.get(DYNAMIC_PROCESS_SETS_ENV) == "1":  # the user started Horovod in dynamic mode
        for ranks in wanted:
            _REGISTERED[ranks] = hvd.add_process_set(list(ranks))
    elif wanted:
        # Each rank's shutdown tells the rendezvous server it is done with the first start's keys,
        # and the server drops them once every rank said so; a rank that restarted and published
        # its new address before the slowest rank's shutdown would lose that address (a hang or a
        # refused connection). The barrier makes ranks shut down together; the pause lets every
        # shutdown reach the server before any rank starts again.
        hvd.barrier()
        hvd.shutdown()
        time.sleep(RESTART_SETTLE_SECONDS)
        forget_process_sets()
        process_sets = [hvd.ProcessSet(list(ranks)) for ranks in wanted]
        hvd.init(process_sets=process_sets)
        _REGISTERED.update(zip(wanted, process_sets, strict=True))
    _STARTED.append(topology)
    return topology


def build_node_groups(topology: Topology) -> NodeGroups:
    """The node-local and cross-node process sets of this worker; every rank must call this.

    Needs Horovod started by ``start_horovod_with_node_sets`` (or in dynamic mode, where
    missing sets are added here, in the same order on every rank).
    """
    topology.require_equal_nodes("A node-aware sync mode")
    hvd = horovod_torch()
    missing = [ranks for ranks in node_process_sets(topology) if ranks not in _REGISTERED]
    if missing:
        if os.environ.get(DYNAMIC_PROCESS_SETS_ENV) != "1":
            raise RuntimeError(
                f"the process sets {missing} were not created when Horovod started; start it through "
                "HorovodStrategy (or start_horovod_with_node_sets) or with HOROVOD_DYNAMIC_PROCESS_SETS=1"
            )
        for ranks in missing:
            _REGISTERED[ranks] = hvd.add_process_set(list(ranks))
    world = topology.size

    def process_set(ranks: tuple[int, ...]) -> Any:
        return hvd.global_process_set if len(ranks) == world else _REGISTERED[ranks]

    local = process_set(topology.nodes[topology.node_index]) if topology.local_size > 1 else None
    cross = process_set(topology.cross_ranks(topology.local_rank)) if topology.num_nodes > 1 else None
    return NodeGroups(topology=topology, local=local, cross=cross)
