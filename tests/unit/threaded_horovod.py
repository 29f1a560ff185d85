"""Horovod for a whole job in one process: every rank a thread, collectives matched by name across ranks.

The unit tier's ``FakeHorovod`` (conftest.py) is one rank that makes up what the others send. The
two-level legs exchange different pieces with different partners over several rounds, which only
real peers can answer, so here every rank of a job runs in its own thread against one
``ThreadedJob``. A collective completes once every rank has submitted it under the same name (the
k-th submission of a name on one rank meets the k-th on every other), as Horovod matches tensors by
name, so ranks may start collectives in different orders. Nothing waits without a deadline: a rank
that never joins a collective, or fails, ends the job with an error naming what was left waiting,
and a test fails instead of hanging.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

import pytest
import torch

from hvd_plugins.core.backend import module as backend_module
from hvd_plugins.core.backend import waits
from hvd_plugins.core.comm import partners, topology, wire, world, world_sum

T = TypeVar("T")

MECHANISM_MODULES: tuple[ModuleType, ...] = (backend_module, waits, partners, topology, wire, world, world_sum)
"""The modules whose ``horovod_torch()`` the two-level path and the sync modes reach (each imported it by name)."""


class JobAborted(RuntimeError):
    """Another rank failed or a collective ran out of time: the remaining ranks stop instead of waiting."""


@dataclass
class _Collective:
    """One collective of the job: what each rank submitted, and what each receives once all have."""

    kind: str
    name: str
    started: float
    inputs: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    error: str | None = None
    complete: bool = False


class RankHorovod:
    """``horovod.torch`` as one rank of a ``ThreadedJob`` sees it: what the package's mechanism calls.

    ``calls`` lists ``(kind, name)`` of every collective this rank submitted, in order.
    """

    Average, Sum, Adasum, Max, Min = "Average", "Sum", "Adasum", "Max", "Min"

    def __init__(self, job: ThreadedJob, rank: int) -> None:
        self._job = job
        self._rank = rank
        self.calls: list[tuple[str, str]] = []
        self._in_place: dict[int, torch.Tensor] = {}  # handle -> the tensor an in-place allreduce writes into

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._job.size

    def local_rank(self) -> int:
        return self._job.placement[self._rank][1]

    def local_size(self) -> int:
        return self._job.workers_per_node

    def cross_rank(self) -> int:
        return self._job.placement[self._rank][0]

    def cross_size(self) -> int:
        return self._job.nodes

    def is_initialized(self) -> bool:
        return True

    def init(self) -> None:
        """Horovod runs already (the job's threads are its ranks)."""

    def alltoall_async(self, tensor: torch.Tensor, splits: Any = None, name: str | None = None) -> int:
        if splits is None:
            if tensor.shape[0] % self._job.size:
                raise ValueError(f"alltoall {name}: {tensor.shape[0]} rows do not split evenly over the job")
            counts = [tensor.shape[0] // self._job.size] * self._job.size
        else:
            counts = [int(count) for count in splits]
        return self._job.submit(self._rank, "alltoall", name, tensor, counts)

    def allreduce_async(
        self, tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: str | None = None
    ) -> int:
        return self._job.submit(self._rank, "allreduce", name, tensor, op or self.Average)

    def allreduce_async_(self, tensor: torch.Tensor, name: str | None = None, op: str | None = None) -> int:
        """Horovod's in-place allreduce: the result is written into ``tensor`` when it is synchronized."""
        handle = self.allreduce_async(tensor.clone(), name=name, op=op)
        self._in_place[handle] = tensor
        return handle

    def allgather_async(self, tensor: torch.Tensor, name: str | None = None) -> int:
        return self._job.submit(self._rank, "allgather", name, tensor, None)

    def alltoall(self, tensor: torch.Tensor, splits: Any = None, name: str | None = None) -> Any:
        return self.synchronize(self.alltoall_async(tensor, splits=splits, name=name))

    def allreduce(
        self, tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: str | None = None
    ) -> torch.Tensor:
        return self.synchronize(self.allreduce_async(tensor, name=name, op=op))

    def allgather(self, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return self.synchronize(self.allgather_async(tensor, name=name))

    def broadcast_parameters(self, params: Any, root_rank: int) -> None:
        """Rank ``root_rank``'s values written into every rank's tensors (named pairs or a dict), in place; here an
        allgather of each tensor, of which every rank keeps the root's row."""
        pairs = list(params.items()) if isinstance(params, dict) else list(params)
        for name, tensor in pairs:
            rows = self.allgather(tensor.detach().reshape(1, -1), name=f"broadcast.{name}")
            with torch.no_grad():
                tensor.copy_(rows[root_rank].view_as(tensor))

    def poll(self, handle: int) -> bool:
        return self._job.poll(self._rank, handle)

    def synchronize(self, handle: int) -> Any:
        result = self._job.synchronize(self._rank, handle)
        target = self._in_place.pop(handle, None)
        return result if target is None else target.copy_(result)


class ThreadedJob:
    """A Horovod job of ``nodes`` x ``workers_per_node`` ranks, one thread each, in this process.

    Ranks fill the nodes one after the other (ranks 0, 1 on node 0 of a 2 x 2 job), or, with
    ``round_robin``, take turns across nodes (ranks 0, 2 on node 0), as horovodrun may place them.
    ``install`` makes the mechanism's ``horovod_torch()`` return the calling thread's rank; ``run``
    runs a function on every rank at once. A collective not complete within ``timeout_s`` of its
    first submission fails, and so does a ``run`` whose ranks have not all returned by then.
    """

    def __init__(
        self, nodes: int = 2, workers_per_node: int = 2, *, round_robin: bool = False, timeout_s: float = 10.0
    ) -> None:
        self.nodes, self.workers_per_node = nodes, workers_per_node
        self.size = nodes * workers_per_node
        self.timeout_s = timeout_s
        self.placement: list[tuple[int, int]] = [
            (rank % nodes, rank // nodes) if round_robin else (rank // workers_per_node, rank % workers_per_node)
            for rank in range(self.size)
        ]
        """``placement[rank] = (node, local rank)``: Horovod's ``cross_rank`` and ``local_rank``."""
        self.ranks = [RankHorovod(self, rank) for rank in range(self.size)]
        self._condition = threading.Condition()
        self._collectives: dict[tuple[str, int], _Collective] = {}
        self._occurrences: list[dict[str, int]] = [{} for _ in range(self.size)]
        self._handles: dict[int, tuple[int, _Collective]] = {}
        self._next_handle = itertools.count(1)
        self._aborted: str | None = None
        self._local = threading.local()

    # ------------------------------------------------------------------ running the ranks
    def install(self, monkeypatch: pytest.MonkeyPatch, *modules: ModuleType, sleeping_wait: bool = True) -> ThreadedJob:
        """Hand the mechanism modules (and ``modules``) this job for Horovod; ``sleeping_wait=False`` makes
        ``wait_for`` poll before it synchronizes, as on a Horovod build whose wait spins."""
        for module in (*MECHANISM_MODULES, *modules):
            monkeypatch.setattr(module, "horovod_torch", self.current)
        monkeypatch.setattr(waits, "synchronize_sleeps", lambda marker=None: sleeping_wait)
        return self

    def current(self) -> RankHorovod:
        """The calling thread's rank (what ``horovod_torch()`` returns once installed)."""
        hvd = getattr(self._local, "hvd", None)
        if hvd is None:
            raise RuntimeError("horovod_torch() was called outside the rank threads of ThreadedJob.run")
        return hvd

    def run(self, work: Callable[[RankHorovod], T]) -> list[T]:
        """``work(hvd)`` on every rank at once, each in its own thread; the results in rank order.

        A rank's exception is raised here (the first rank's that failed on its own, not because
        another rank had failed); ranks still running after ``timeout_s`` raise TimeoutError.
        """
        results: dict[int, T] = {}
        errors: dict[int, BaseException] = {}

        def rank_main(hvd: RankHorovod) -> None:
            self._local.hvd = hvd
            try:
                results[hvd.rank()] = work(hvd)
            except BaseException as error:  # reported by run(); the other ranks stop waiting for this one
                errors[hvd.rank()] = error
                self.abort(f"rank {hvd.rank()} failed: {type(error).__name__}: {error}")

        threads = [
            threading.Thread(target=rank_main, args=(hvd,), name=f"rank{hvd.rank()}", daemon=True) for hvd in self.ranks
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        running = [thread.name for thread in threads if thread.is_alive()]
        if running:
            pending = self.pending()
            self.abort(f"ranks {running} still running after {self.timeout_s}s")
            for thread in threads:
                thread.join(1.0)
            raise TimeoutError(f"ranks {running} did not finish within {self.timeout_s}s; waiting: {pending}")
        if errors:
            own = [error for error in errors.values() if not isinstance(error, JobAborted)]
            raise (own or list(errors.values()))[0]
        return [results[rank] for rank in range(self.size)]

    def abort(self, reason: str) -> None:
        """End the job: every wait and poll raises JobAborted from now on."""
        with self._condition:
            self._aborted = self._aborted or reason
            self._condition.notify_all()

    def pending(self) -> dict[str, list[int]]:
        """Collectives some rank submitted that are not complete: name -> the ranks that submitted it."""
        with self._condition:
            return {c.name: sorted(c.inputs) for c in self._collectives.values() if not c.complete}

    # ------------------------------------------------------------------ collectives
    def submit(self, rank: int, kind: str, name: str | None, tensor: torch.Tensor, detail: Any) -> int:
        """Enter ``rank``'s part of a collective; it completes when the last rank's part arrives."""
        with self._condition:
            self._raise_if_aborted()
            name = name if name is not None else f"unnamed.{kind}"
            occurrence = self._occurrences[rank].get(name, 0)
            self._occurrences[rank][name] = occurrence + 1
            collective = self._collectives.setdefault(
                (name, occurrence), _Collective(kind, name, started=time.monotonic())
            )
            if collective.kind != kind:
                collective.error = f"{name}: rank {rank} submitted an {kind}, another rank an {collective.kind}"
            collective.inputs[rank] = (tensor.detach().clone(), detail)
            self.ranks[rank].calls.append((kind, name))
            if len(collective.inputs) == self.size:
                if collective.error is None:
                    try:
                        collective.outputs = _COMPUTE[kind](collective, self.size)
                    except ValueError as error:
                        collective.error = str(error)
                collective.complete = True
                self._condition.notify_all()
            handle = next(self._next_handle)
            self._handles[handle] = (rank, collective)
            return handle

    def poll(self, rank: int, handle: int) -> bool:
        with self._condition:
            self._raise_if_aborted()
            collective = self._collective_of(rank, handle)
            if not collective.complete and time.monotonic() - collective.started > self.timeout_s:
                raise TimeoutError(f"{collective.name}: only ranks {sorted(collective.inputs)} ever submitted it")
            return collective.complete

    def synchronize(self, rank: int, handle: int) -> Any:
        """Wait for the collective (at most ``timeout_s`` from its first submission) and return this rank's result."""
        with self._condition:
            collective = self._collective_of(rank, handle)
            remaining = collective.started + self.timeout_s - time.monotonic()
            self._condition.wait_for(lambda: collective.complete or self._aborted is not None, timeout=remaining)
            self._raise_if_aborted()
            if not collective.complete:
                raise TimeoutError(f"{collective.name}: only ranks {sorted(collective.inputs)} ever submitted it")
            del self._handles[handle]
            if collective.error is not None:
                raise RuntimeError(collective.error)
            return collective.outputs[rank]

    def _collective_of(self, rank: int, handle: int) -> _Collective:
        owner, collective = self._handles.get(handle, (None, None))
        if owner != rank or collective is None:
            raise ValueError(f"rank {rank} holds no handle {handle} (never returned, or already synchronized)")
        return collective

    def _raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise JobAborted(self._aborted)


def _same(collective: _Collective, what: str, values: Sequence[Any]) -> None:
    if any(value != values[0] for value in values):
        raise ValueError(f"{collective.name}: the ranks' {what} differ: {list(values)}")


def _allreduce(collective: _Collective, size: int) -> dict[int, torch.Tensor]:
    """Every rank's tensor combined in rank order (Sum, Average, Max, Min); each rank gets its own copy."""
    tensors = [collective.inputs[rank][0] for rank in range(size)]
    _same(collective, "ops", [collective.inputs[rank][1] for rank in range(size)])
    _same(collective, "shapes", [tuple(t.shape) for t in tensors])
    _same(collective, "dtypes", [t.dtype for t in tensors])
    op = collective.inputs[0][1]
    if op in (RankHorovod.Sum, RankHorovod.Average):
        total = tensors[0].clone()
        for tensor in tensors[1:]:
            total += tensor
        if op == RankHorovod.Average:
            if not total.dtype.is_floating_point:
                raise ValueError(f"{collective.name}: this fake averages floating-point tensors only")
            total /= size
    elif op in (RankHorovod.Max, RankHorovod.Min):
        stacked = torch.stack(tensors)
        total = stacked.amax(0) if op == RankHorovod.Max else stacked.amin(0)
    else:
        raise ValueError(f"{collective.name}: op {op!r} is not implemented by this fake")
    return {rank: total.clone() for rank in range(size)}


def _alltoall(collective: _Collective, size: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Rows ``splits[d]`` of each sender go to rank ``d``; a rank receives them concatenated in sender order,
    with the received splits, as Horovod's ``synchronize`` returns them."""
    _same(collective, "dtypes", [collective.inputs[rank][0].dtype for rank in range(size)])
    _same(collective, "row shapes", [tuple(collective.inputs[rank][0].shape[1:]) for rank in range(size)])
    pieces: dict[int, list[torch.Tensor]] = {}
    for sender in range(size):
        tensor, splits = collective.inputs[sender]
        if len(splits) != size or sum(splits) != tensor.shape[0] or min(splits) < 0:
            raise ValueError(f"{collective.name}: rank {sender} splits {tensor.shape[0]} rows as {splits}")
        pieces[sender] = list(tensor.split(splits))
    return {
        receiver: (
            torch.cat([pieces[sender][receiver] for sender in range(size)]),
            torch.tensor([collective.inputs[sender][1][receiver] for sender in range(size)], dtype=torch.int32),
        )
        for receiver in range(size)
    }


def _allgather(collective: _Collective, size: int) -> dict[int, torch.Tensor]:
    """Every rank's tensor, concatenated along the first dimension in rank order."""
    _same(collective, "dtypes", [collective.inputs[rank][0].dtype for rank in range(size)])
    _same(collective, "row shapes", [tuple(collective.inputs[rank][0].shape[1:]) for rank in range(size)])
    gathered = torch.cat([collective.inputs[rank][0] for rank in range(size)])
    return {rank: gathered.clone() for rank in range(size)}


_COMPUTE: dict[str, Callable[[_Collective, int], dict[int, Any]]] = {
    "allreduce": _allreduce,
    "alltoall": _alltoall,
    "allgather": _allgather,
}
