"""One protocol for a collective in flight, of one round or several: ``progress()`` never waits, ``wait()`` does.

Every sum, gather and average the package starts without waiting follows it (a partner leg, a group
sum, the two-level legs, a chunked cross-node sum, a buffer average), so a caller that holds several
moves them all the same way: ``progress()`` lets an operation whose current round has arrived start
its next one, ``ready()`` says whether ``wait()`` would return at once, and ``wait(meanwhile)`` blocks
until the result is there, calling ``meanwhile()`` before each round it waits for, so other
operations move on while this one blocks (``finish_all``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")
T_co = TypeVar("T_co", covariant=True)
Meanwhile = Callable[[], None] | None
"""Called before each blocking wait for a round (``finish_all`` moves the other operations on there)."""


class InFlight(ABC, Generic[T_co]):
    """A collective operation started and not yet awaited."""

    @abstractmethod
    def progress(self) -> None:
        """Start the next round if the current one has arrived; never waits, does nothing once done."""

    @abstractmethod
    def ready(self) -> bool:
        """Whether ``wait()`` would return at once; moves the operation on, as ``progress`` does."""

    @abstractmethod
    def wait(self, meanwhile: Meanwhile = None) -> T_co:
        """Wait for every round and return the result; ``meanwhile()`` runs before each round waited for."""


class Then(InFlight[U]):
    """``operation`` in flight, its result passed through ``finish`` once, when it is awaited."""

    def __init__(self, operation: InFlight[T], finish: Callable[[T], U]) -> None:
        self.operation = operation
        self.finish = finish

    def progress(self) -> None:
        self.operation.progress()

    def ready(self) -> bool:
        return self.operation.ready()

    def wait(self, meanwhile: Meanwhile = None) -> U:
        return self.finish(self.operation.wait(meanwhile))


def finish_all(pending: Sequence[InFlight[T]]) -> list[T]:
    """Wait for every operation, in order; while one waits for a round, the later ones move on."""
    return list(finish_each(pending))


def finish_each(pending: Sequence[InFlight[T]]) -> Iterator[T]:
    """Each operation's result as it is waited for, in order (the caller may let one go before the next lands);
    while one waits for a round, the later ones move on."""
    for index, operation in enumerate(pending):
        later = pending[index + 1 :]

        def move_later_on(later: Sequence[InFlight[T]] = later) -> None:
            for other in later:
                other.progress()

        yield operation.wait(move_later_on if later else None)
