"""Sums among a few workers (one node, or one worker per node) without Horovod process sets.

Every collective here is a GLOBAL ``hvd.alltoall`` whose splits send data only to the worker's
partners (zero elements to everyone else), so Horovod runs one process set, the global one, and
needs no restart to learn about groups: with process sets every collective negotiates per set on
every Horovod cycle, and static sets need a second rendezvous (docs/measurements.rst, "Partners
without process sets").

A group of two exchanges whole tensors in one round (each member sends its tensor to the other
and both add the two in the group's order, so both hold the same bits; the bytes equal a ring's).
Larger groups reduce-scatter and allgather, two rounds with the ring's bytes. A group that spans
every worker uses Horovod's allreduce.

A pair that crosses nodes side by side with other pairs (``PartnerGroup.relay_lane``) relays
instead: one member sends, the other adds and sends the sum back, two one-way rounds with the
same bytes, half the pairs starting in each direction so both directions of the link stay busy.
A Gloo connection carrying data both ways at once moved it slower and less steadily than one way
at a time (docs/measurements.rst, "Relay or exchange").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.waits import wait_for
from hvd_plugins.core.comm.compression import Compressor, NoCompression
from hvd_plugins.core.comm.counters import CommCounters, Scope
from hvd_plugins.core.comm.in_flight import InFlight, Meanwhile, finish_all
from hvd_plugins.core.comm.shards import ShardLayout
from hvd_plugins.core.comm.wire import nbytes

EXCHANGE_MAX_SIZE = 2
"""Groups up to this size sum by exchanging whole tensors (one round, a ring's bytes at size 2)."""
HALF_TYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PartnerGroup:
    """Workers that reduce together, seen from one of them.

    ``ranks`` are global ranks in the group's own order (for a node: by local rank); shard ``i``
    of a reduce-scatter belongs to ``ranks[i]``.
    """

    ranks: tuple[int, ...]
    rank: int
    world: int
    relay_lane: int | None = None
    """Set on pairs that run side by side over the same links (the cross-node pairs, one per local
    rank): such a pair sums by relaying, and the member that sends first alternates with the lane."""

    def __post_init__(self) -> None:
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in the partner group {self.ranks}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This worker's position in ``ranks``."""
        return self.ranks.index(self.rank)

    @property
    def spans_world(self) -> bool:
        return self.size == self.world

    @property
    def relays(self) -> bool:
        """Whether sums go one way at a time (a pair with a lane, short of every worker)."""
        return self.relay_lane is not None and self.size == 2 and not self.spans_world

    @property
    def first_sender(self) -> int:
        """In a relaying pair, the member that sends its tensor first; the other adds and sends back."""
        assert self.relay_lane is not None and self.size == 2
        return self.ranks[self.relay_lane % 2]

    @property
    def partner(self) -> int:
        """The other member of a pair."""
        assert self.size == 2
        return self.ranks[1 - self.index]

    @property
    def others(self) -> tuple[int, ...]:
        """The other members, in ascending rank: the order alltoall sends to and delivers from."""
        return tuple(rank for rank in sorted(self.ranks) if rank != self.rank)

    def splits(self, numel: int) -> torch.Tensor:
        """alltoall splits sending ``numel`` elements to each other member and none elsewhere (not to itself)."""
        splits = [0] * self.world
        for rank in self.others:
            splits[rank] = numel
        return torch.tensor(splits, dtype=torch.int32)

    def pieces(self, received: torch.Tensor, own: torch.Tensor) -> list[torch.Tensor]:
        """Every member's piece in group order: ``own`` at this worker's place, the others from ``received``."""
        by_rank = dict(zip(self.others, received.view(len(self.others), own.numel()), strict=True))
        by_rank[self.rank] = own
        return [by_rank[rank] for rank in self.ranks]

    def ascending(self, per_member: Sequence[torch.Tensor]) -> torch.Tensor:
        """One send buffer from a piece per member (group order): the other members' pieces in ascending rank."""
        pieces = [per_member[self.ranks.index(rank)] for rank in self.others]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class HorovodRound(InFlight[list[torch.Tensor]]):
    """One Horovod collective in flight, ``handle`` (one round); a subclass says what ``wait()`` makes of it."""

    handle: Any

    def progress(self) -> None:
        """One round: nothing to start."""

    def ready(self) -> bool:
        return bool(horovod_torch().poll(self.handle))


class PartnerAlltoall(HorovodRound):
    """A partner-only alltoall in flight (one round); ``wait()`` returns every member's piece, decompressed.

    A worker's own piece never travels (copying it to itself through Horovod costs a copy and
    buffer space); it goes through the same compression locally, so it holds the bits the other
    members receive.
    """

    def __init__(self, per_member: Sequence[torch.Tensor], group: PartnerGroup, codec: Compressor, name: str) -> None:
        if group.size < 2:
            raise ValueError(f"a partner alltoall needs a group of two or more, got {group.ranks}")
        self.group = group
        self.codec = codec
        self.own, self.ctx = codec.compress(per_member[group.index])
        self.piece_nbytes = nbytes(self.own)
        """Bytes of one member's piece on the wire."""
        wire, _ = codec.compress(group.ascending(per_member))
        self.handle = horovod_torch().alltoall_async(wire, splits=group.splits(self.own.numel()), name=name)

    def wait(self, meanwhile: Meanwhile = None) -> list[torch.Tensor]:
        if meanwhile is not None:
            meanwhile()
        received = wait_for(self.handle)[0]
        return [self.codec.decompress(piece, self.ctx) for piece in self.group.pieces(received, self.own)]


def add_in_order(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of ``pieces``, added one after the other in the order given (half types in float32).

    Every member of a group adds the same pieces in the same (group) order, so all hold the same bits.
    """
    total = accumulating(pieces[0]) + accumulating(pieces[1]) if len(pieces) > 1 else accumulating(pieces[0]).clone()
    for piece in pieces[2:]:
        total += piece
    return total


def start_reduce_scatter(tensor: torch.Tensor, group: PartnerGroup, codec: Compressor, name: str) -> PartnerAlltoall:
    """Start summing ``tensor`` over ``group`` so member ``i`` gets shard ``i``; ``finish_reduce_scatter`` waits.

    ``tensor.numel()`` must be a multiple of the group's size (``ShardLayout.padded``).
    """
    return PartnerAlltoall(tensor.chunk(group.size), group, codec, name)


def finish_reduce_scatter(pending: PartnerAlltoall, meanwhile: Meanwhile = None) -> torch.Tensor:
    """This worker's shard of the group's sum, added in group order (half types in float32)."""
    return add_in_order(pending.wait(meanwhile))


def accumulating(values: torch.Tensor) -> torch.Tensor:
    """``values`` in a type fit to add many of them: float16 and bfloat16 become float32."""
    return values.float() if values.dtype in HALF_TYPES else values


def start_allgather(shard: torch.Tensor, group: PartnerGroup, codec: Compressor, name: str) -> PartnerAlltoall:
    """Start sending ``shard`` to every member; ``finish_allgather`` waits."""
    return PartnerAlltoall([shard] * group.size, group, codec, name)


class WorldAllgather(HorovodRound):
    """Every worker's equal ``shard``, gathered by Horovod's allgather in rank order; ``wait()`` returns one piece per
    worker, views of the one buffer received. Nothing is sent per peer (an alltoall repeats the shard once per peer
    in its send buffer)."""

    def __init__(self, shard: torch.Tensor, name: str) -> None:
        self.count = shard.numel()
        self.handle = horovod_torch().allgather_async(shard.reshape(-1), name=name)

    def wait(self, meanwhile: Meanwhile = None) -> list[torch.Tensor]:
        if meanwhile is not None:
            meanwhile()
        return list(wait_for(self.handle).split(self.count))


def start_slices_gather(shard: torch.Tensor, group: PartnerGroup, name: str) -> InFlight[list[torch.Tensor]]:
    """Start gathering every member's equal ``shard`` (in group order), uncompressed: Horovod's allgather where the
    group is every worker, a partner alltoall within a smaller group (no process sets)."""
    if group.spans_world:
        return WorldAllgather(shard, name)
    return PartnerAlltoall([shard] * group.size, group, NoCompression(), name)


def finish_allgather(pending: PartnerAlltoall, meanwhile: Meanwhile = None) -> torch.Tensor:
    """Every member's shard, back to back in group order."""
    return torch.cat(pending.wait(meanwhile))


def start_one_way(tensor: torch.Tensor, to: int | None, world: int, name: str) -> Any:
    """A global alltoall that sends ``tensor`` to worker ``to`` only (nothing with ``to=None``); returns its handle."""
    splits = [0] * world
    if to is not None:
        splits[to] = tensor.numel()
    send = tensor if to is not None else tensor[:0]
    return horovod_torch().alltoall_async(send, splits=torch.tensor(splits, dtype=torch.int32), name=name)


class GroupSum(InFlight[torch.Tensor]):
    """``tensor`` summed over ``group``, in flight: one round for groups of up to two (two for a
    relaying pair), two for larger.

    Every member must start the same sums in the same order with tensors of equal size and
    dtype; every member ends with the same bits. A group of every worker uses Horovod's
    allreduce, which was faster than a partner exchange of the same bytes on a shaped link
    (docs/measurements.rst, "Sums over every worker").
    ``wait()`` returns the sum, as precise as ``tensor`` or more (half types added by this module
    come back float32). ``relay=False`` makes a relaying pair exchange instead (one round).
    ``progress()`` lets a sum that is not awaited yet start its second round in the background.
    """

    def __init__(
        self, tensor: torch.Tensor, group: PartnerGroup, codec: Compressor, name: str, relay: bool = True
    ) -> None:
        self.tensor = tensor
        self.group = group
        self.codec = codec
        self.name = name
        self._allreduce: Any = None
        self._exchange: PartnerAlltoall | None = None
        self._scatter: PartnerAlltoall | None = None
        self._gather: PartnerAlltoall | None = None
        self._relay_out: Any = None  # first round of a relay: the first sender's tensor
        self._relay_back: Any = None  # second round: the sum, back to the first sender
        self._relay_total: torch.Tensor | None = None
        self.nbytes = 0
        """Bytes of ``tensor`` on the wire (what this worker hands to the sum), 0 when nothing is sent."""
        if group.size == 1 or tensor.numel() == 0:
            return
        self.wire, self.ctx = codec.compress(tensor)
        self.nbytes = nbytes(self.wire)
        plain = NoCompression()
        if group.spans_world:
            hvd = horovod_torch()
            self._allreduce = hvd.allreduce_async(self.wire, op=hvd.Sum, name=name)
        elif relay and group.relays:
            to = group.partner if group.rank == group.first_sender else None
            self._relay_out = start_one_way(self.wire, to, group.world, f"{name}.r1")
        elif group.size <= EXCHANGE_MAX_SIZE:
            self._exchange = start_allgather(self.wire, group, plain, name)
        else:
            padded = ShardLayout(self.wire.numel(), group.size, group.index).padded(self.wire)
            self._scatter = start_reduce_scatter(padded, group, plain, f"{name}.rs")

    def progress(self) -> None:
        """Start the second round if the first has arrived, without waiting (a sum in flight moves on)."""
        if self._first_round_pending() and self._first_round_arrived():
            self.start_second_round()

    def _first_round_pending(self) -> bool:
        return self._relay_out is not None or self._scatter is not None

    def _first_round_arrived(self) -> bool:
        first = self._relay_out if self._relay_out is not None else getattr(self._scatter, "handle", None)
        return first is not None and bool(horovod_torch().poll(first))

    def start_second_round(self) -> None:
        """Wait for the first round and start the second: a relay's way back, or the allgather of this shard."""
        if self._relay_out is not None:
            received = wait_for(self._relay_out)[0]
            self._relay_out = None
            group = self.group
            if group.rank == group.first_sender:
                self._relay_back = start_one_way(self.wire, None, group.world, f"{self.name}.r2")
                return
            rows = [received, self.wire] if group.index == 1 else [self.wire, received]  # group order
            total = add_in_order(self._decompressed(rows))
            self._relay_total = total.to(self.wire.dtype)  # the wire type, as it travels back
            self._relay_back = start_one_way(self._relay_total, group.first_sender, group.world, f"{self.name}.r2")
        if self._scatter is not None:
            total = add_in_order(self._decompressed(self._scatter.wait()))
            shard = total.to(self.wire.dtype)  # back to the wire type for the gather
            self._scatter = None
            self._gather = start_allgather(shard, self.group, NoCompression(), f"{self.name}.ag")

    def ready(self) -> bool:
        """Whether ``wait()`` would return at once; moves a sum whose first round arrived on (``progress``)."""
        self.progress()
        if self._first_round_pending():
            return False  # the first of two rounds is still in flight
        last = [self._allreduce, self._relay_back, getattr(self._exchange, "handle", None)]
        last.append(getattr(self._gather, "handle", None))
        handle = next((h for h in last if h is not None), None)
        return handle is None or bool(horovod_torch().poll(handle))

    def _decompressed(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Pieces that travelled in the wire type, back in the type this sum was started with."""
        return [self.codec.decompress(piece, self.ctx) for piece in pieces]

    def wait(self, meanwhile: Meanwhile = None) -> torch.Tensor:
        if meanwhile is not None and self._first_round_pending():
            meanwhile()
        self.start_second_round()
        if meanwhile is not None:
            meanwhile()
        if self._allreduce is not None:
            return self.codec.decompress(wait_for(self._allreduce), self.ctx)
        if self._relay_back is not None:
            received = wait_for(self._relay_back)[0]
            total = received if self._relay_total is None else self._relay_total
            return accumulating(self.codec.decompress(total, self.ctx))
        if self._exchange is not None:
            return add_in_order(self._decompressed(self._exchange.wait()))
        if self._gather is not None:
            return self.codec.decompress(finish_allgather(self._gather)[: self.tensor.numel()], self.ctx)
        return self.tensor.clone()


def group_sum(
    tensors: Sequence[torch.Tensor],
    group: PartnerGroup,
    codec: Compressor,
    name: str,
    counters: CommCounters,
    scope: Scope,
) -> list[torch.Tensor]:
    """Sum each tensor over ``group``, counting its bytes under ``scope``.

    Each round is started for every tensor before any is awaited, so Horovod can fuse them.
    """
    pending = [GroupSum(tensor, group, codec, f"{name}.{index}") for index, tensor in enumerate(tensors)]
    for sum_ in pending:
        if sum_.nbytes:
            counters.record(scope, sum_.nbytes)
    with counters.waiting():
        return finish_all(pending)
