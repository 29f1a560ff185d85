"""What an elastic reset does to the gradient sync: one rule for the Trainer's strategy and Fabric's.

Horovod has started again with new ranks and a new size. A sync mode that holds a layout of the old
world (node groups, shards: ``world_shaped``) is torn down without a collective (``abandon``) and
dropped; the face builds a new one at its next setup and hands it the old one's ``state_dict``
(DASO's schedule, the measured route). Any other mode follows the new world in place: it stays, and
its optimizers forget the allreduces the old world left in flight, which would never complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from torch.optim import Optimizer

from hvd_plugins.core.backend.optimizer import forget_failed_allreduces


class ResettableSync(Protocol):
    """What the rule needs of a gradient sync."""

    world_shaped: bool

    def abandon(self, optimizers: Sequence[Optimizer]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...


S = TypeVar("S", bound=ResettableSync)


def sync_after_reset(sync: S | None, optimizers: Sequence[Optimizer]) -> tuple[S | None, dict[str, Any] | None]:
    """The sync the new world trains with (None: build one at the next setup), and the state to build it with.

    ``optimizers`` are the ones the sync was set up with.
    """
    if sync is None:
        return None, None
    if sync.world_shaped:
        sync.abandon(optimizers)
        return None, sync.state_dict()
    for optimizer in optimizers:
        forget_failed_allreduces(optimizer)
    return sync, None
