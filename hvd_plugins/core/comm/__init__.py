"""How bytes move: compression, topology and partners, flat and two-level allreduce."""

from hvd_plugins.core.comm.compression import FP16Compression, NoCompression, compressor_by_name
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.hierarchical import hierarchical_allreduce_
from hvd_plugins.core.comm.partners import PartnerGroup, group_sum
from hvd_plugins.core.comm.topology import (
    NodeGroups,
    Topology,
    build_node_groups,
    discover_topology,
    start_horovod_and_discover,
)

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
