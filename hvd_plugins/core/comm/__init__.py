"""MECHANISM: how bytes move. No sync mode lives here (``core.sync`` holds them).

One in-flight protocol (``in_flight``), one flat layout (``layout``) on one shard arithmetic
(``shards``), buckets and their readiness from backward hooks (``backward_buckets``, ``reducer``),
partner legs (``partners``), the two-level sum (``two_level``), cross-node shard sums
(``cross_node``), buffer averages, compression and wire types, counters, topology.
"""

from hvd_plugins.core.comm.compression import FP16Compression, NoCompression, compressor_by_name
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.partners import PartnerGroup, group_sum
from hvd_plugins.core.comm.topology import (
    NodeGroups,
    Topology,
    build_node_groups,
    discover_topology,
    start_horovod_and_discover,
)
from hvd_plugins.core.comm.two_level import hierarchical_allreduce_

__all__ = [
    "CommCounters",
    "FP16Compression",
    "NoCompression",
    "NodeGroups",
    "PartnerGroup",
    "Scope",
    "Topology",
    "build_node_groups",
    "compressor_by_name",
    "discover_topology",
    "group_sum",
    "hierarchical_allreduce_",
    "start_horovod_and_discover",
]
