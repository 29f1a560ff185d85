"""The table from a ``HorovodConfig`` to its sync mode: the one place that knows every mode.

A new mode takes one ``case`` here (and its name in ``core.config.SYNC_MODES``).
"""

from __future__ import annotations

import logging

import torch

from hvd_plugins.core.comm.compression import compressor_by_name
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.topology import build_node_groups, discover_topology
from hvd_plugins.core.comm.world import spans_nodes
from hvd_plugins.core.config import HIERARCHICAL_IMPLS, SYNC_MODES, HorovodConfig
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.sync.bucketed import BucketedAllreduceSync, uses_buckets
from hvd_plugins.core.sync.daso.mode import DasoGradientSync
from hvd_plugins.core.sync.flat import AdasumOptimizerSync, HorovodOptimizerSync
from hvd_plugins.core.sync.hierarchical.mode import HierarchicalGradientSync
from hvd_plugins.core.sync.sharded.mode import ShardedGradientSync

log = logging.getLogger(__name__)


GATHER_DTYPES: dict[str, torch.dtype | None] = {"full": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``HorovodConfig.gather_dtype`` names and the dtype units are gathered in (None: the parameters' own)."""


def make_gradient_sync(
    config: HorovodConfig, counters: CommCounters, device: torch.device | None = None, precision: str | None = None
) -> GradientSync:
    """The gradient sync ``config.sync`` names, for a model on ``device`` trained at Lightning's ``precision``.
    Node-aware modes learn the layout here: a collective."""
    compressor = compressor_by_name(config.compression)
    match config.sync, config.hierarchical_impl:
        case ("allreduce" | "hierarchical", _) if config.shard != "none":
            topology = discover_topology() if config.sync == "hierarchical" else None
            if topology is not None and not topology.equal_nodes:
                log.warning(
                    f"shard={config.shard!r} with sync='hierarchical': nodes run different numbers of workers "
                    f"({[len(node) for node in topology.nodes]}), so the state is sharded over every worker instead"
                )
            return ShardedGradientSync(
                config.shard,
                compressor,
                config.op,
                counters,
                config.bucket_bytes,
                config.shard_checkpoint,
                node_groups=build_node_groups(topology) if topology is not None and topology.equal_nodes else None,
                compress_node_local=config.compress_node_local,
                auto_wrap_policy=config.auto_wrap_policy,
                reshard_after_forward=config.reshard_after_forward,
                device=device,
                param_dtype=GATHER_DTYPES[config.gather_dtype(precision, device is not None and device.type == "cuda")],
            )
        case ("allreduce", _) | ("hierarchical", "native"):  # native: Horovod's own two-level allreduce
            scope = Scope.CROSS_NODE if spans_nodes() else Scope.NODE_LOCAL
            if config.sync == "allreduce" and uses_buckets(
                config.op, config.gradient_predivide_factor, config.sparse_as_dense
            ):
                return BucketedAllreduceSync(compressor, config.op, counters, scope, config.bucket_bytes)
            flat = AdasumOptimizerSync if config.op == "adasum" else HorovodOptimizerSync
            return flat(
                compressor,
                config.op,
                counters,
                scope,
                gradient_predivide_factor=config.gradient_predivide_factor,
                sparse_as_dense=config.sparse_as_dense,
            )
        case ("hierarchical", "portable"):
            return HierarchicalGradientSync(
                build_node_groups(discover_topology()),
                compressor,
                config.op,
                counters,
                compress_node_local=config.compress_node_local,
                bucket_bytes=config.bucket_bytes,
                flat_below_bytes=config.flat_below_bytes,
                tune_route=config.tune_hierarchical_route,
            )
        case ("daso", _):
            assert config.daso is not None  # HorovodConfig fills it in for sync="daso"
            groups = build_node_groups(discover_topology())
            return DasoGradientSync(config.daso, groups, compressor, config.op, counters, config.bucket_bytes)
    raise ValueError(
        f"sync={config.sync!r} with hierarchical_impl={config.hierarchical_impl!r} is not a known pair; "
        f"sync is one of {SYNC_MODES}, hierarchical_impl one of {HIERARCHICAL_IMPLS}"
    )
