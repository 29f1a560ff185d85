"""Which workers share a node, learned from Horovod, and who each worker sums with.

Horovod numbers nodes by ``cross_rank`` and workers inside a node by ``local_rank``; global
ranks need not be contiguous per node, so the layout is gathered from every worker rather
than assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.partners import PartnerGroup


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


@dataclass(frozen=True)
class NodeGroups:
    """The partners one worker sums with: its node, and its peers on the other nodes.

    ``None`` where the sync needs no collective: a node of one worker has no ``local`` group and a
    single node has no ``cross`` group. A group that spans every worker sums with Horovod's
    allreduce; smaller ones with partner-only alltoalls (``comm.partners``), so Horovod never
    needs process sets.
    """

    topology: Topology
    local: PartnerGroup | None  # this worker's node, by local rank
    cross: PartnerGroup | None  # the workers with this local rank, one per node
    world: PartnerGroup  # every worker, by global rank


def start_horovod_and_discover(hvd: Any) -> Topology:
    """Start Horovod unless it runs already (a script's own ``hvd.init()`` is kept) and gather the layout.

    Collective: every rank calls it at the same point. No process set is created and Horovod is
    never restarted: node-aware syncs reach their partners through global alltoalls.
    """
    if not hvd.is_initialized():
        hvd.init()
    return discover_topology()


def build_node_groups(topology: Topology) -> NodeGroups:
    """The node-local and cross-node partners of this worker (no communication)."""
    topology.require_equal_nodes("A node-aware sync mode")
    node = topology.nodes[topology.node_index]
    local = PartnerGroup(node, topology.rank, topology.size) if topology.local_size > 1 else None
    cross_ranks = topology.cross_ranks(topology.local_rank)
    lane = topology.local_rank  # neighbouring local ranks start their relays in opposite directions
    cross = PartnerGroup(cross_ranks, topology.rank, topology.size, lane) if topology.num_nodes > 1 else None
    world = PartnerGroup(tuple(range(topology.size)), topology.rank, topology.size)
    return NodeGroups(topology=topology, local=local, cross=cross, world=world)
