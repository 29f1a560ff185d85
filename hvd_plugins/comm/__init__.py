"""How bytes move: compression, topology (process sets), flat and two-level allreduce."""

from hvd_plugins.comm.compression import FP16Compression, NoCompression, compressor_by_name
from hvd_plugins.comm.counters import CommCounters, Scope
from hvd_plugins.comm.hierarchical import hierarchical_allreduce_
from hvd_plugins.comm.topology import (
    NodeGroups,
    Topology,
    build_node_groups,
    discover_topology,
    start_horovod_with_node_sets,
)

__all__ = [
    "CommCounters",
    "FP16Compression",
    "NoCompression",
    "NodeGroups",
    "Scope",
    "Topology",
    "build_node_groups",
    "compressor_by_name",
    "discover_topology",
    "hierarchical_allreduce_",
    "start_horovod_with_node_sets",
]
