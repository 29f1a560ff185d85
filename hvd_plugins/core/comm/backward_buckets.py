"""Gradient buckets that backward fills: which of an optimizer's buckets are complete, told by per-parameter hooks.

A sum that starts only once backward has ended leaves the link idle while backward runs; Horovod's
own flat allreduce starts each gradient from a backward hook instead. The two-level legs do the
same per bucket: buckets hold the parameters in reverse order (the order backward usually produces
their gradients, as in DDP), and the moment every parameter of a bucket has its gradient for the
step's last backward pass, ``on_ready(index)`` starts that bucket's sum while backward goes on.
Every worker builds the same buckets from the same parameter order, so all start the same sums,
though not always in the same order (Horovod matches collectives by name).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import Parameter

from hvd_plugins.core.comm.buckets import bucket_tensors


class BackwardBuckets:
    """Buckets of ``parameters`` (reverse order unless ``backward_order=False``, at most ``bucket_bytes`` each;
    or the ``buckets`` given) and their readiness this step.

    ``passes_needed`` is how many backward passes accumulate into the step (``set_backward_passes``
    and held backward passes raise it); a parameter counts as ready at its last one. While
    ``armed`` is false the hooks only return. ``reset`` starts the next step.
    """

    def __init__(
        self,
        parameters: Sequence[Parameter],
        bucket_bytes: int,
        on_ready: Callable[[int], None],
        passes: int = 1,
        backward_order: bool = True,
        buckets: Sequence[Sequence[Parameter]] | None = None,
        alone_from_bytes: int | None = None,
    ) -> None:
        self.parameters: tuple[torch.Tensor, ...] = tuple(parameters)
        self.alone_from_bytes = alone_from_bytes
        order = reversed(self.parameters) if backward_order else self.parameters
        self.buckets: list[list[torch.Tensor]] = (
            bucket_tensors(order, bucket_bytes, alone_from_bytes)
            if buckets is None
            else [list(bucket) for bucket in buckets]
        )
        self._bucket_of = {parameter: index for index, bucket in enumerate(self.buckets) for parameter in bucket}
        self._on_ready = on_ready
        self.armed = False
        self.passes_per_step = passes
        """Backward passes a step accumulates; ``passes_needed`` is this step's, held passes included."""
        self.passes_needed = passes
        self.started: set[int] = set()
        self._passes: dict[torch.Tensor, int] = {}
        self._missing = [len(bucket) for bucket in self.buckets]
        self._hooks: list[Any] = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in self.parameters]

    def matches(self, parameters: Sequence[Parameter]) -> bool:
        """Whether these buckets were built for exactly ``parameters`` (the trainable ones may change)."""
        return len(parameters) == len(self.parameters) and all(
            a is b for a, b in zip(parameters, self.parameters, strict=True)
        )

    def bucket_nbytes(self) -> list[int]:
        return [sum(p.numel() * p.element_size() for p in bucket) for bucket in self.buckets]

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        if not self.armed:
            return
        passes = self._passes.get(parameter, 0) + 1
        self._passes[parameter] = passes
        index = self._bucket_of.get(parameter)
        if passes != self.passes_needed or index is None or index in self.started:
            return
        self._missing[index] -= 1
        if self._missing[index] == 0:
            self.started.add(index)
            self._on_ready(index)

    def reset(self, passes: int) -> None:
        """A new step: nothing ready, nothing started, ``passes`` backward passes to come (from now on)."""
        self.passes_per_step = passes
        self.passes_needed = passes
        self.started.clear()
        self._passes.clear()
        self._missing = [len(bucket) for bucket in self.buckets]

    def remove(self) -> None:
        """Drop the hooks: these buckets are done with."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.armed = False
