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
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.comm.gradients import gradient_to_send
from hvd_plugins.core.comm.in_flight import InFlight, finish_all
from hvd_plugins.core.comm.layout import FlatLayout
from hvd_plugins.core.comm.parameters import optimizer_parameters
from hvd_plugins.core.comm.wire import nbytes

BucketOperation = Callable[[int, torch.Tensor, str], InFlight[torch.Tensor | None] | None]
"""Starts a mode's operation on bucket ``index``'s flattened gradients (named; the same name on every worker).
A result as long as the bucket or longer is written back into the gradients; a None result writes nothing.
None instead of an operation: nothing to do."""


class KeepsBuckets:
    """A bucket operation that keeps each bucket's flat buffer and puts its result elsewhere (a reduce-scatter into
    the workers' slices), as a DDP communication hook may: the reducer lends a new buffer each step, laid out by
    ``layouts`` (padded as the operation splits it), hands it over when the bucket is complete, and lands nothing
    in the gradients, so no whole gradient outlives the operation."""

    def __init__(self, start: BucketOperation, layouts: Sequence[FlatLayout]) -> None:
        self.start = start
        self.layouts = list(layouts)

    def __call__(self, index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
        return self.start(index, flat, name)


VIEW_ALONE_BYTES = 2**20
"""A gradient of at least this many bytes is a bucket of its own, summed where it lies: no copy in or out, and its
sum starts the moment backward has it. One more collective to negotiate costs less than two passes over a MiB (on a
2-core machine, a model of a few large tensors ran at 0.66x of a hand-written Horovod loop with every gradient copied
into 32 MiB buckets, and at 1.05x this way); smaller ones share buckets. Only where ``alone`` is asked for."""


class BucketReducer:
    """One optimizer's trainable ``parameters`` in buckets, each reduced by ``operation`` as backward completes it.

    Each bucket has one flat buffer, laid out by its ``FlatLayout``, kept from step to step, and each parameter's
    gradient is a view of it, as DDP's ``gradient_as_bucket_view``: a hook lends the views before the bucket's first
    gradient is accumulated (also after ``zero_grad(set_to_none=True)``), so backward accumulates into the bucket
    itself, the operation sums it where it lies, and nothing is copied back. A gradient that is not its view when
    the bucket starts (a user replaced it, a sparse one) is copied in once and the view takes its place;
    ``counters`` count those bytes (``copied_bytes``) and the sparse ones (``view_fallbacks``).

    An operation that keeps its buckets (``KeepsBuckets``) gets a new buffer each step, lent the same way and laid
    out as it asks, and nothing is written back. ``alone``: a gradient of ``VIEW_ALONE_BYTES`` or more is a bucket
    of its own, handed over as itself.
    """

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
        alone: bool = False,
        counters: CommCounters | None = None,
    ) -> None:
        self.operation = operation
        self.keeps_buckets = isinstance(operation, KeepsBuckets)
        self.land_early = land_early
        """Land a bucket whose operation has arrived as soon as a later bucket starts, while backward runs (its
        buffers go at once); else every bucket lands at ``finish``: backward leaves the gradients as it made them."""
        self.max_in_flight = max_in_flight
        """With ``land_early``: at most this many buckets travel at once; starting one more lands the oldest first
        (waiting for it), which bounds the memory of buffers in flight (None: no bound)."""
        self.name = name
        self.counters = counters if counters is not None else CommCounters()
        split_alone = VIEW_ALONE_BYTES if alone else None
        self.buckets = BackwardBuckets(
            parameters, bucket_bytes, self.start, passes, backward_order, buckets, split_alone
        )
        self.layouts = (
            operation.layouts
            if isinstance(operation, KeepsBuckets)
            else [FlatLayout.of(b) for b in self.buckets.buckets]
        )
        self._flats: dict[int, torch.Tensor] = {}
        """Each bucket's flat buffer, which its gradients view: kept from step to step, or, ``keeps_buckets``, this
        step's (handed to the operation when the bucket starts). None for a gradient alone: it is its own bucket."""
        self._lent: set[int] = set()  # the buckets whose views were lent to the gradients this step
        self._in_flight: dict[int, InFlight[torch.Tensor | None] | None] = {}
        self._landing: dict[int, torch.Tensor | None] = {}  # where each started bucket's result goes
        self._lenders = [
            parameter.register_hook(self._lender(index))
            for index, bucket in enumerate(self.buckets.buckets)
            if not self._alone(bucket)
            for parameter in bucket
            if parameter.requires_grad
        ]

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
        """Start bucket ``index``'s operation on its flat gradients; buckets in flight move on meanwhile."""
        flat, landing = self._bucket(index)
        self._in_flight[index] = self.operation(index, flat, f"{self.name}.{index}")
        self._landing[index] = landing
        for earlier, other in self._in_flight.items():
            if other is None:
                continue
            if self.land_early and other.ready():  # arrived: land it now, so its buffers go while backward runs
                self._land(earlier, other.wait())
                self._in_flight[earlier] = None
            else:
                other.progress()
        travelling = [i for i in sorted(self._in_flight) if self._in_flight[i] is not None]
        while self.land_early and self.max_in_flight is not None and len(travelling) > self.max_in_flight:
            oldest = travelling.pop(0)
            other = self._in_flight[oldest]
            assert other is not None
            self._land(oldest, other.wait())
            self._in_flight[oldest] = None

    def _alone(self, bucket: Sequence[torch.Tensor]) -> bool:
        """Whether ``bucket`` is one large gradient handed over as itself (``alone``)."""
        return not self.keeps_buckets and len(bucket) == 1 and self.buckets.alone_from_bytes is not None

    def _lender(self, index: int) -> Callable[[torch.Tensor], None]:
        def lend(gradient: torch.Tensor) -> None:
            if index not in self._lent:
                self._lend(index, gradient)

        return lend

    def _lend(self, index: int, gradient: torch.Tensor) -> None:
        """The first gradient of bucket ``index`` this step is about to be accumulated: every trainable parameter of
        the bucket without a gradient (``zero_grad`` set it to None) gets its view of the bucket, zeroed, so
        backward adds into the bucket and nothing is copied in. A parameter with no gradient this step sends the
        zeros it was lent, as every worker must send alike, and the step sees what it would with None."""
        self._lent.add(index)
        layout = self.layouts[index]
        flat = self._flats.get(index)
        if flat is None or flat.dtype != gradient.dtype or flat.device != gradient.device:
            flat = self._flats[index] = layout.new_flat(gradient, padded=self.keeps_buckets)
            flat[layout.numel :].zero_()
        for parameter, view in zip(self.buckets.buckets[index], layout.views(flat), strict=True):
            if parameter.grad is None and parameter.requires_grad and _fits(parameter, view):
                parameter.grad = view.zero_()

    def _bucket(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bucket ``index``'s gradients as one flat tensor to hand over, and where its result must land (None:
        nowhere, the operation puts it elsewhere)."""
        parameters = self.buckets.buckets[index]
        layout = self.layouts[index]
        if self._alone(parameters):
            gradient = gradient_to_send(parameters[0])
            if gradient.is_contiguous():
                return gradient.view(-1), gradient.view(-1)
        like = next((p.grad for p in parameters if p.grad is not None and not p.grad.is_sparse), parameters[0])
        flat = self._flats.pop(index, None) if self.keeps_buckets else self._flats.get(index)
        if flat is None or flat.dtype != like.dtype or flat.device != like.device:
            flat = layout.new_flat(like, padded=self.keeps_buckets)
            flat[layout.numel :].zero_()
            if not self.keeps_buckets:
                self._flats[index] = flat
        self._into_views(parameters, layout, flat, keep=not self.keeps_buckets)
        if self.keeps_buckets:  # the whole gradients go once the operation drops the bucket: nothing lands in them
            return flat, None
        return flat, flat

    def _into_views(
        self, parameters: Sequence[torch.Tensor], layout: FlatLayout, flat: torch.Tensor, keep: bool
    ) -> None:
        """Every gradient of the bucket in ``flat``: copied in where it is not its view already (``keep``: and the
        view made the parameter's gradient)."""
        for parameter, view in zip(parameters, layout.views(flat), strict=True):
            gradient = parameter.grad
            if gradient is None:
                view.zero_()  # no gradient this step: zeros, as every worker must send alike
            elif gradient.is_sparse:
                view.copy_(gradient.to_dense())
                self.counters.view_fallbacks += 1
                self.counters.copied_bytes += nbytes(view)
            elif gradient.data_ptr() == view.data_ptr() and gradient.shape == view.shape:
                continue  # backward accumulated into the bucket itself
            else:
                view.copy_(gradient)
                self.counters.copied_bytes += nbytes(view)
            if keep and parameter.requires_grad and _fits(parameter, view):
                parameter.grad = view

    def _land(self, index: int, result: torch.Tensor | None) -> None:
        landing = self._landing.pop(index, None)
        if result is None or landing is None or result.data_ptr() == landing.data_ptr():
            return  # nothing to land, or summed where it lies (the bucket the gradients view, or the gradient)
        landing.copy_(result[: landing.numel()])
        self.counters.copied_bytes += nbytes(landing)

    def finish(self, waiting: AbstractContextManager[object] | None = None) -> None:
        """Start what backward did not, wait for every bucket (in order), land the results; next step."""
        for index in range(len(self.buckets.buckets)):
            if index not in self._in_flight:
                self.start(index)
        running = [(index, operation) for index, operation in sorted(self._in_flight.items()) if operation is not None]
        with waiting if waiting is not None else nullcontext():
            results = finish_all([operation for _, operation in running])
        for (index, _), result in zip(running, results, strict=True):
            self._land(index, result)
        self._in_flight.clear()
        self._landing.clear()
        self._lent.clear()
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
        for handle in self._lenders:
            handle.remove()
        self._lenders.clear()
        self._in_flight.clear()
        self._landing.clear()
        self._flats.clear()


def _fits(parameter: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``view`` can be ``parameter``'s gradient (a freed ZeRO-3 parameter is empty and cannot take one)."""
    return parameter.shape == view.shape and parameter.dtype == view.dtype and parameter.device == view.device


class OptimizerReducers:
    """A reducer per optimizer, built again when the optimizer's trainable parameters change (unfreezing).

    A reducer with buckets in flight is kept until they land: the parameters that became trainable
    meanwhile are the mode's to handle for that step.
    """

    def __init__(
        self,
        bucket_bytes: int,
        operation: BucketOperation,
        backward_order: bool = True,
        alone: bool = False,
        counters: CommCounters | None = None,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.operation = operation
        self.backward_order = backward_order
        self.alone = alone
        """``BucketReducer``'s ``alone`` for every reducer built here."""
        self.counters = counters
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
            trainable,
            self.bucket_bytes,
            self.operation,
            name,
            passes,
            self.backward_order,
            alone=self.alone,
            counters=self.counters,
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
            late,
            self.bucket_bytes,
            self.operation,
            name,
            backward_order=False,
            alone=self.alone,
            counters=self.counters,
        )
        late_reducer.finish()
        late_reducer.remove()

    def remove_all(self) -> None:
        for reducer in self._reducers.values():
            reducer.remove()
        self._reducers.clear()
