"""WHEN DASO syncs across nodes: a pure state machine, fed one event per optimizer step and per epoch.

No Horovod, Lightning or torch here, so every transition can be unit-tested on a synthetic loss
sequence. One object owns every counter (epoch, step in the epoch, the message in flight).

Reading of the reference's ``(global_skips, local_skips, batches_to_wait)`` tuples: warmup is
``(0, 0, 0)``, i.e. a blocking cross-node average after every batch, written here as
``global_skips=1, batches_to_wait=0``. Cycling starts at ``(4, 1, 1)``: a cross-node send every
4th optimizer step (``global_skips=4``), the local sync every step (``local_skips=1``, which is
what the strategy always does: gradients are averaged inside the node every step, so local
skips are not a knob here) and the result received one step after the send
(``batches_to_wait=1``). When the loss stalls, ``global_skips`` is divided by
``skip_reduction_factor`` and ``batches_to_wait`` drops by one; once ``global_skips`` is 1 the
next stall resets to ``(max_global_skips, max_global_skips // local_skip_factor)``.
``batches_to_wait`` is always kept below ``global_skips``, so at most one message is in flight.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from hvd_plugins.daso.config import DasoConfig

CYCLE_START_GLOBAL_SKIPS = 4
CYCLE_START_BATCHES_TO_WAIT = 1


class Phase(str, Enum):
    """Training phases; warmup and cooldown average across nodes after every batch."""

    WARMUP = "warmup"
    CYCLING = "cycling"
    COOLDOWN = "cooldown"

    @property
    def code(self) -> int:
        """A number for loggers that only take numbers: 0 warmup, 1 cycling, 2 cooldown."""
        return list(Phase).index(self)


@dataclass(frozen=True)
class StepPlan:
    """What the syncer does after one optimizer step, in this order.

    ``receive``: wait for the message in flight and merge it with weight ``2 * merge_wait``
    for the local parameters (skipped as a merge, but still awaited, when ``blocking`` follows,
    because the blocking average of the current parameters supersedes the stale one).
    ``blocking``: average across nodes now and wait (``p = S / N``).
    ``send``: start a non-blocking cross-node sum of the current parameters.
    """

    receive: bool = False
    blocking: bool = False
    send: bool = False
    merge_wait: int = 0

    @property
    def communicates(self) -> bool:
        return self.receive or self.blocking or self.send


@dataclass(frozen=True)
class EpochRecord:
    """The settings one epoch ran with, and the loss it ended with."""

    epoch: int
    phase: Phase
    global_skips: int
    batches_to_wait: int
    loss: float | None


@dataclass
class DasoSchedule:
    """The DASO schedule: phase, ``global_skips`` and ``batches_to_wait`` per epoch.

    Drive it with :meth:`on_optimizer_step` after every optimizer step, :meth:`finish_epoch`
    after the epoch's last batch, then :meth:`end_epoch` with the epoch's mean loss.
    ``total_epochs=None`` means training length unknown: no cooldown.
    """

    config: DasoConfig
    total_epochs: int | None = None
    epoch: int = field(default=0, init=False)
    step_in_epoch: int = field(default=0, init=False)
    phase: Phase = field(default=Phase.WARMUP, init=False)
    global_skips: int = field(default=1, init=False)
    batches_to_wait: int = field(default=0, init=False)
    best_loss: float | None = field(default=None, init=False)
    epochs_without_improvement: int = field(default=0, init=False)
    last_plan: StepPlan = field(default_factory=StepPlan, init=False)
    history: list[EpochRecord] = field(default_factory=list, init=False, repr=False)
    _sent_at: int | None = field(default=None, init=False, repr=False)
    _in_flight_wait: int = field(default=0, init=False, repr=False)
    _epoch_closed_blocking: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.total_epochs is not None and self.total_epochs < 1:
            raise ValueError(f"total_epochs={self.total_epochs!r} must be >= 1 or None (unknown length)")
        self._enter_epoch(previous=None, plateau=False)

    # ------------------------------------------------------------------ queries
    def phase_of(self, epoch: int) -> Phase:
        """The phase epoch ``epoch`` (0-based) runs in; warmup wins when both overlap."""
        if epoch < self.config.warmup_epochs:
            return Phase.WARMUP
        if self.total_epochs is not None and epoch >= self.total_epochs - self.config.cooldown_epochs:
            return Phase.COOLDOWN
        return Phase.CYCLING

    @property
    def blocking(self) -> bool:
        """Every cross-node sync of this epoch waits for its result (``batches_to_wait == 0``)."""
        return self.batches_to_wait == 0

    @property
    def in_flight(self) -> bool:
        return self._sent_at is not None

    def is_sync_step(self, step_in_epoch: int) -> bool:
        """Whether the ``step_in_epoch``-th optimizer step (1-based) starts a cross-node sync."""
        return step_in_epoch % self.global_skips == 0

    def receive_due(self, step_in_epoch: int) -> bool:
        """Whether the message in flight is due at the ``step_in_epoch``-th step."""
        return self._sent_at is not None and step_in_epoch - self._sent_at >= self._in_flight_wait

    # ------------------------------------------------------------------ transitions
    def on_optimizer_step(self, last_batch_of_epoch: bool) -> StepPlan:
        """Advance one optimizer step and say what to communicate after it."""
        self.step_in_epoch += 1
        step = self.step_in_epoch
        receive = self.receive_due(step) or (last_batch_of_epoch and self.in_flight)
        sync_now = self.is_sync_step(step)
        blocking = last_batch_of_epoch or (sync_now and self.blocking)
        send = sync_now and not blocking
        plan = StepPlan(receive=receive, blocking=blocking, send=send, merge_wait=self._in_flight_wait)
        if receive:
            self._sent_at = None
        if send:
            self._sent_at, self._in_flight_wait = step, self.batches_to_wait
        self._epoch_closed_blocking = blocking
        self.last_plan = plan
        return plan

    def finish_epoch(self) -> StepPlan:
        """What is still owed when the epoch is over: the message in flight, a closing blocking sync.

        Usually nothing, because the last batch already synced; it matters when the last batch
        did not step the optimizer (or the loop stopped early), so every epoch ends with all
        workers holding the same parameters.
        """
        plan = StepPlan(receive=self.in_flight, blocking=not self._epoch_closed_blocking)
        self._sent_at = None
        self._epoch_closed_blocking = True
        if plan.communicates:
            self.last_plan = plan
        return plan

    def end_epoch(self, loss: float | None) -> EpochRecord:
        """Record the epoch's loss (mean over all workers) and choose the next epoch's settings.

        ``loss=None`` (or NaN) means no loss was seen: the phase still advances, the skips stay.
        Returns the record of the epoch that just ended.
        """
        if self.in_flight:
            raise RuntimeError("end_epoch() with a cross-node message still in flight; call finish_epoch() first")
        value = None if loss is None or not math.isfinite(loss) else float(loss)
        record = EpochRecord(self.epoch, self.phase, self.global_skips, self.batches_to_wait, value)
        self.history.append(record)
        plateau = self._judge(value)
        previous = self.phase
        self.epoch += 1
        self.step_in_epoch = 0
        self._epoch_closed_blocking = False
        self._enter_epoch(previous, plateau)
        return record

    def _judge(self, loss: float | None) -> bool:
        """True when the loss has not improved by more than ``stability_level`` for ``stable_epochs``."""
        if loss is None:
            return False
        if self.best_loss is None or loss < self.best_loss - self.config.stability_level * abs(self.best_loss):
            self.best_loss = loss
            self.epochs_without_improvement = 0
            return False
        self.epochs_without_improvement += 1
        return self.epochs_without_improvement >= self.config.stable_epochs

    def _enter_epoch(self, previous: Phase | None, plateau: bool) -> None:
        self.phase = self.phase_of(self.epoch)
        if self.phase is not Phase.CYCLING:
            self._set(1, 0)
        elif previous is not Phase.CYCLING:
            self._set(
                min(CYCLE_START_GLOBAL_SKIPS, self.config.max_global_skips),
                CYCLE_START_BATCHES_TO_WAIT,
            )
            self.epochs_without_improvement = 0
        elif plateau:
            if self.global_skips == 1:
                self._set(self.config.max_global_skips, self.config.max_global_skips // self.config.local_skip_factor)
            else:
                self._set(self.global_skips // self.config.skip_reduction_factor, self.batches_to_wait - 1)
            self.epochs_without_improvement = 0

    def _set(self, global_skips: int, batches_to_wait: int) -> None:
        self.global_skips = max(1, global_skips)
        self.batches_to_wait = min(max(0, batches_to_wait), self.global_skips - 1)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Where the schedule stands between epochs, for checkpoints."""
        return {
            "epoch": self.epoch,
            "phase": self.phase.value,
            "global_skips": self.global_skips,
            "batches_to_wait": self.batches_to_wait,
            "best_loss": self.best_loss,
            "epochs_without_improvement": self.epochs_without_improvement,
            "history": [{**asdict(record), "phase": record.phase.value} for record in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.phase = Phase(state["phase"])
        self._set(int(state["global_skips"]), int(state["batches_to_wait"]))
        self.best_loss = state["best_loss"]
        self.epochs_without_improvement = int(state["epochs_without_improvement"])
        self.history = [EpochRecord(**{**record, "phase": Phase(record["phase"])}) for record in state["history"]]
        self.step_in_epoch = 0
        self._sent_at = None
        self._epoch_closed_blocking = False
        # A resumed run may be given another length or warmup: re-derive the phase from them.
        if self.phase_of(self.epoch) is not self.phase:
            self._enter_epoch(previous=self.phase, plateau=False)
