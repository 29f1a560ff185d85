"""Elastic commits of a sharded optimizer: each worker keeps its own part and a copy of one other worker's.

A sharded worker's slice of the optimizer state exists nowhere else, so a commit that kept only
the own part would lose a dead worker's slice, and one that gathered the whole state everywhere
would give back the memory sharding saved. A commit here keeps, on every worker, its own part and
the part of the worker before it on a ring that alternates hosts (``holder_ring``): where hosts run
equal numbers of workers, every copy is on another host, so losing any one host loses no slice.
Host memory per worker: 2/N of the optimizer state.

Where the shards already have copies (sharded inside the node: every node holds every slice of its
layout), a commit keeps the own part only.

After an elastic reset ``rebuild`` learns which survivor holds which part, says which are lost (two
workers holding the same part died together) on every worker alike, and otherwise hands every
worker every part, from which it takes its slices of the new layout.

The parts travel as serialized bytes (``torch.save``): a commit's parts are small, of many shapes,
and must pass one alltoall.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import torch

from hvd_plugins.core.comm.topology import Topology
from hvd_plugins.core.comm.world import gather_over_world, send_one_way, sum_over_world, world_rank, world_size
from hvd_plugins.core.sync.base import OWN_PARTS_KEY
from hvd_plugins.core.sync.parts import consolidate, per_parameter

COMMIT_FORMAT = "hvd_plugins.sharded_commit/1"
"""Marks what an elastic commit keeps of one sharded optimizer: the parts this worker holds."""


class LostShardsError(RuntimeError):
    """Every copy of some part of the committed optimizer state left with the workers that held it."""


def is_commit(state: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(state, dict) and state.get("format") == COMMIT_FORMAT


def commit_state(
    held: dict[int, torch.Tensor], workers: int, param_groups: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """What a commit keeps of one optimizer: ``held`` parts (by shard rank) of a layout over ``workers``, and the
    hyper-parameters, alike on every worker, where a resize rescales learning rates as in any optimizer state."""
    return {
        "format": COMMIT_FORMAT,
        "workers": workers,
        OWN_PARTS_KEY: held,
        "param_groups": [dict(g) for g in param_groups],
    }


def whole_state(state: Mapping[str, Any], parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole optimizer state of a commit, from every part (``rebuild``), with the commit's hyper-parameters."""
    whole = consolidate(parts)
    whole["param_groups"] = [dict(group) for group in state["param_groups"]]
    return whole


def whole_values(parts: Sequence[Mapping[str, Any]]) -> dict[int, torch.Tensor]:
    """The whole values of the parameters whose slices the parts keep (a unit's, ``shard="parameters"``), by their
    index in the optimizer's state; empty where the parts keep none."""
    ordered = sorted(parts, key=lambda part: part["rank"])
    values: dict[int, torch.Tensor] = {}
    for index, bucket in enumerate(ordered[0]["buckets"]):
        if "values" in bucket:
            values.update(per_parameter(bucket, [part["buckets"][index]["values"] for part in ordered]))
    return values


# ---------------------------------------------------------------------- who keeps whose copy
def holder_ring(topology: Topology) -> tuple[int, ...]:
    """Every rank once, first local ranks 0 of each host, then local ranks 1, ...: neighbours are on other hosts."""
    nodes = topology.nodes
    places = sorted((local, node, rank) for node, ranks in enumerate(nodes) for local, rank in enumerate(ranks))
    return tuple(rank for _, _, rank in places)


def keeper_of(rank: int, ring: Sequence[int]) -> int:
    """The worker that keeps a copy of ``rank``'s part: the next on the ring."""
    return ring[(ring.index(rank) + 1) % len(ring)]


def kept_by(rank: int, ring: Sequence[int]) -> int:
    """The worker whose part ``rank`` keeps a copy of: the previous on the ring."""
    return ring[(ring.index(rank) - 1) % len(ring)]


# ---------------------------------------------------------------------- bytes
def to_bytes(part: Mapping[str, Any]) -> torch.Tensor:
    """``part`` serialized into a uint8 tensor on the CPU."""
    buffer = io.BytesIO()
    torch.save(dict(part), buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)


# ---------------------------------------------------------------------- commit
def replicate(part: Mapping[str, Any], ring: Sequence[int], name: str) -> dict[int, torch.Tensor]:
    """This worker's part and the copy it keeps of another's, by shard rank (one alltoall; a collective).

    The parts of a flat sharded layout, whose shard ranks are the global ranks ``ring`` orders.
    """
    own, rank = to_bytes(part), world_rank()
    if world_size() == 1:
        return {rank: own}
    received = send_one_way(own, keeper_of(rank, ring), f"{name}.replica")
    return {rank: own, kept_by(rank, ring): received.clone()}


# ---------------------------------------------------------------------- reset
def rebuild(held: Mapping[int, torch.Tensor], workers: int, name: str) -> list[dict[str, Any]]:
    """Every part of the committed layout over ``workers``, on every worker, from what each survivor ``held``.

    A collective of the new world. Raises ``LostShardsError`` on every worker alike when some part
    has no survivor holding it.
    """
    rank, size = world_rank(), world_size()
    holds = torch.zeros(1, workers, dtype=torch.int64)
    for shard in held:
        holds[0, shard] = 1
    holders = gather_over_world(holds, f"{name}.holders")
    missing = [shard for shard in range(workers) if not bool(holders[:, shard].any())]
    if missing:
        raise LostShardsError(
            f"the elastic commit's optimizer state is lost for the slices of worker(s) {missing} of {workers}: every "
            "worker that held them (the owner and the one keeping its copy, on another host) left the job together, "
            "and training on would leave a hole in the optimizer state. Restart from the last checkpoint on disk "
            "(trainer.fit(..., ckpt_path=...)); keep hosts alive in pairs, or commit to disk more often."
        )
    if size == 1:
        return [from_bytes(held[shard]) for shard in range(workers)]
    provider = [int(torch.nonzero(holders[:, shard])[0, 0]) for shard in range(workers)]
    mine = [shard for shard in range(workers) if provider[shard] == rank]
    lengths = torch.zeros(workers, dtype=torch.int64)
    for shard in mine:
        lengths[shard] = held[shard].numel()
    lengths = sum_over_world(lengths, f"{name}.lengths")
    payload = torch.cat([held[shard] for shard in mine]) if mine else torch.zeros(0, dtype=torch.uint8)
    everything = gather_over_world(payload, f"{name}.parts")
    # the allgather concatenates by rank; each rank sent its parts in shard order
    order = [shard for source in range(size) for shard in range(workers) if provider[shard] == source]
    pieces = torch.split(everything, [int(lengths[shard]) for shard in order])
    parts = {shard: from_bytes(piece) for shard, piece in zip(order, pieces, strict=True)}
    return [parts[shard] for shard in range(workers)]
