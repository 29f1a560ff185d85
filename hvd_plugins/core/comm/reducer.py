"""One bucketed reducer for every mode that reduces gradients: buckets, their readiness, and an operation per bucket.

As torch DDP's reducer serves every comm hook, this serves every sync mode: it flattens one
optimizer's gradients bucket by bucket (``comm.backward_buckets``), starts the mode's operation on a
bucket the moment backward has completed it (while ``armed``; else all start after backward),
lets the buckets in flight move on while others start, and writes each result back into the
gradients. What the operation does with a bucket (a two-level sum, a sum inside the node, a
reduce-scatter) is the mode's; how buckets fill, start and land is this module's.

Accumulation: ``passes`` backward passes make one step, and a held backward (``hold_next_backward``)
adds one; a bucket starts at its last pass. A second backward before the step while buckets are
in flight must ``finish`` them first (the mode decides how to fold the settled result).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn import Parameter
from torch.optim import Optimizer

from hvd_plugins.core.comm.backward_buckets import BackwardBuckets
from hvd_plugins.core.comm.buckets import flatten, unflatten_into
from hvd_plugins.core.comm.gradients import gradient_to_send
from hvd_plugins.core.comm.in_flight import InFlight, finish_all
from hvd_plugins.core.comm.parameters import optimizer_parameters

BucketOperation = Callable[[int, torch.Tensor, str], InFlight[torch.Tensor | None] | None]
"""Starts a mode's operation on bucket ``index``'s flattened gradients (named; the same name on every worker).
A result as long as the bucket or longer is written back into the gradients; a None result writes nothing
(the operation put its result elsewhere, as a sharded mode does). None instead of an operation: nothing to do."""


VIEW_ALONE_BYTES = 2**20
"""With ``views``, a gradient of at least this many bytes is a bucket of its own, summed where it lies: no copy in
or out, and its sum starts the moment backward has it. One more collective to negotiate costs less than two
passes over a MiB (on a 2-core machine, a model of a few large tensors ran at 0.66x of a hand-written Horovod
loop with every gradient copied into 32 MiB buckets, and at 1.05x this way); smaller ones share buckets."""


class BucketReducer:
    """One optimizer's trainable ``parameters`` in buckets, each reduced by ``operation`` as backward completes it."""

    def __init__(
        self,
        parameters: Sequence[Parameter],
        bucket_bytes: int,
        operation: BucketOperation,
        name: str,
        passes: int = 1,
        backward_order: bool = True,
        buckets: Sequence[Sequence[Parameter]] | None = None,
        land_early: bool = False,
        max_in_flight: int | None = None,
        views: bool = False,
        padded_numels: Sequence[int] | None = None,
    ) -> None:
        self.operation = operation
        self.views = views
        self.padded_numels = list(padded_numels) if padded_numels is not None else None
        """Each bucket's flat length, padding included (a sharded mode's layout): the gradients are copied once,
        into a buffer the operation splits as it is, and nothing writes results back into them (the operation puts
        its result elsewhere), so a bucket's gradients are let go as soon as it starts."""
        """Hand a bucket of one contiguous gradient to the operation as a view of that gradient, not a copy: the
        operation may then write its result there (an in-place sum), and nothing is copied back. Gradients of
        ``VIEW_ALONE_BYTES`` or more then get buckets of their own."""
        self.land_early = land_early
        """Land a bucket whose operation has arrived as soon as a later bucket starts, while backward runs (its
        buffers go at once); else every bucket lands at ``finish``: backward leaves the gradients as it made them."""
        self.max_in_flight = max_in_flight
        """With ``land_early``: at most this many buckets travel at once; starting one more lands the oldest first
        (waiting for it), which bounds the memory of buffers in flight (None: no bound)."""
        self.name = name
        alone = VIEW_ALONE_BYTES if views else None
        self.buckets = BackwardBuckets(parameters, bucket_bytes, self.start, passes, backward_order, buckets, alone)
        self._in_flight: dict[int, tuple[list[torch.Tensor], InFlight[torch.Tensor | None] | None]] = {}

    @property
    def armed(self) -> bool:
        """Whether backward's hooks start buckets (else ``finish`` starts them all)."""
        return self.buckets.armed

    @armed.setter
    def armed(self, armed: bool) -> None:
        self.buckets.armed = armed

    @property
    def in_flight(self) -> bool:
        """Whether some bucket of this step has started."""
        return bool(self._in_flight)

    def matches(self, parameters: Sequence[Parameter]) -> bool:
        return self.buckets.matches(parameters)

    def bucket_nbytes(self) -> list[int]:
        return self.buckets.bucket_nbytes()

    def start(self, index: int) -> None:
        """Flatten bucket ``index``'s gradients and start its operation; buckets in flight move on meanwhile."""
        gradients = [gradient_to_send(p) for p in self.buckets.buckets[index]]
        if self.padded_numels is not None:
            operation = self.operation(
                index, flatten_padded(gradients, self.padded_numels[index]), f"{self.name}.{index}"
            )
            gradients = []  # its result goes elsewhere: the whole gradients may go once the operation drops them
        else:
            operation = self.operation(index, self._flat(gradients), f"{self.name}.{index}")
        self._in_flight[index] = (gradients, operation)
        for earlier, (its_gradients, other) in self._in_flight.items():
            if other is None:
                continue
            if self.land_early and other.ready():  # arrived: land it now, so its buffers go while backward runs
                self._land(its_gradients, other.wait())
                self._in_flight[earlier] = ([], None)  # landed: its gradients are no longer this reducer's to hold
            else:
                other.progress()
        travelling = [i for i in sorted(self._in_flight) if self._in_flight[i][1] is not None]
        while self.land_early and self.max_in_flight is not None and len(travelling) > self.max_in_flight:
            oldest = travelling.pop(0)
            its_gradients, other = self._in_flight[oldest]
            assert other is not None
            self._land(its_gradients, other.wait())
            self._in_flight[oldest] = ([], None)

    def _flat(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        if self.views and len(gradients) == 1 and gradients[0].is_contiguous():
            return gradients[0].view(-1)
        return flatten(gradients)

    @staticmethod
    def _land(gradients: list[torch.Tensor], result: torch.Tensor | None) -> None:
        if result is None:
            return
        if len(gradients) == 1 and result.data_ptr() == gradients[0].data_ptr():
            return  # the result is the gradient itself (a view bucket summed in place)
        unflatten_into(result, gradients)

    def finish(self, waiting: AbstractContextManager[object] | None = None) -> None:
        """Start what backward did not, wait for every bucket (in order), write the results back; next step."""
        for index in range(len(self.buckets.buckets)):
            if index not in self._in_flight:
                self.start(index)
        started = [self._in_flight[index] for index in sorted(self._in_flight)]
        running = [(gradients, operation) for gradients, operation in started if operation is not None]
        with waiting if waiting is not None else nullcontext():
            results = finish_all([operation for _, operation in running])
        for (gradients, _), result in zip(running, results, strict=True):
            self._land(gradients, result)
        self._in_flight.clear()
        self.buckets.reset(self.buckets.passes_per_step)

    def set_backward_passes(self, passes: int) -> None:
        """``passes`` backward passes make the next steps."""
        self.buckets.reset(passes)

    def hold_next_backward(self) -> None:
        """The next backward only adds to the gradients: every parameter's countdown gains one pass."""
        self.buckets.passes_needed += 1

    def remove(self) -> None:
        """Drop the hooks: this reducer is done with."""
        self.buckets.remove()
        self._in_flight.clear()


def flatten_padded(tensors: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """``tensors`` end to end in one new buffer of ``numel`` elements, zeros after them."""
    first = tensors[0]
    flat = torch.empty(numel, dtype=first.dtype, device=first.device)
    offset = 0
    for tensor in tensors:
        flat[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
        offset += tensor.numel()
    flat[offset:].zero_()
    return flat


class OptimizerReducers:
    """A reducer per optimizer, built again when the optimizer's trainable parameters change (unfreezing).

    A reducer with buckets in flight is kept until they land: the parameters that became trainable
    meanwhile are the mode's to handle for that step.
    """

    def __init__(
        self, bucket_bytes: int, operation: BucketOperation, backward_order: bool = True, views: bool = False
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.operation = operation
        self.backward_order = backward_order
        self.views = views
        """``BucketReducer.views`` for every reducer built here."""
        self._reducers: dict[int, BucketReducer] = {}

    def for_optimizer(self, optimizer: Optimizer, name: str, passes: int) -> BucketReducer:
        """``optimizer``'s reducer (named ``name``; ``passes`` backward passes a step when built anew)."""
        trainable = optimizer_parameters(optimizer, trainable_only=True)
        reducer = self._reducers.get(id(optimizer))
        if reducer is not None and (reducer.matches(trainable) or reducer.in_flight):
            return reducer
        if reducer is not None:
            reducer.remove()
        reducer = BucketReducer(
            trainable, self.bucket_bytes, self.operation, name, passes, self.backward_order, views=self.views
        )
        self._reducers[id(optimizer)] = reducer
        return reducer

    def existing(self, optimizer: Optimizer) -> BucketReducer | None:
        """``optimizer``'s reducer if one was built."""
        return self._reducers.get(id(optimizer))

    def reduce_late(self, optimizer: Optimizer, reducer: BucketReducer) -> None:
        """Reduce, at once, the trainable parameters ``reducer`` does not hold: made trainable while its buckets
        were in flight, they missed that step's buckets (the same on every worker, so the collectives match)."""
        trainable = optimizer_parameters(optimizer, trainable_only=True)
        if reducer.matches(trainable):
            return
        planned = set(reducer.buckets.parameters)
        late = [p for p in trainable if p not in planned]
        if not late:
            return
        name = f"{reducer.name}.late"
        late_reducer = BucketReducer(
            late, self.bucket_bytes, self.operation, name, backward_order=False, views=self.views
        )
        late_reducer.finish()
        late_reducer.remove()

    def remove_all(self) -> None:
        for reducer in self._reducers.values():
            reducer.remove()
        self._reducers.clear()
