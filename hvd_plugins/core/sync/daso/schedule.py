"""WHEN DASO syncs across nodes: a pure state machine, fed one event per optimizer step and per epoch.

No Horovod, Lightning or torch here, so every transition can be unit-tested on a synthetic loss
sequence. One object owns every counter (epoch, step in the epoch, the message in flight).

Phases. Warmup and cooldown epochs are synchronous data parallelism: the gradients of every
step are averaged over ALL workers (see ``DasoParameterSync.gradients_over_all_workers``), so parameters
and optimizer state never differ and no parameter sync runs; they are written
``global_skips=1, batches_to_wait=0``. Cycling epochs average gradients inside the node only and
sync parameters across nodes every ``global_skips`` steps, the result arriving
``batches_to_wait`` steps later; the epoch's last batch syncs blocking.

The cycling settings follow heat's DASO (``epoch_loss_logic``) as ``(global_skips, local_skips,
batches_to_wait)``: cycling starts at ``(4, 1, 1)``; on a plateau ``global_skips`` and
``local_skips`` are divided by ``skip_reduction_factor`` and ``batches_to_wait`` drops by one,
neither going below 1; on a plateau with ``global_skips == 1`` they reset to ``(max_global_skips,
max_global_skips // local_skip_factor, max_global_skips // local_skip_factor)``. With the defaults:
``(4,1,1) -> (2,1,1) -> (1,1,1) -> (8,2,2) -> (4,1,1) ...``, so cycling never blocks mid-epoch.
``local_skips`` is recorded for fidelity only: gradients are averaged inside the node every step.

The plateau detector is heat's ``DetectMetricPlateau(patience=stable_epochs,
threshold=stability_level)``, mode min, relative threshold: an epoch improves when its loss is
below ``best * (1 - stability_level)`` (``best * (1 + stability_level)`` for a negative best);
``best`` starts at infinity; a plateau fires when the count of consecutive non-improving epochs
exceeds ``stable_epochs`` (the 3rd one with the default 2), and the count restarts. Only the
losses of the last warmup epoch and of cycling epochs that are followed by another cycling epoch
are judged, as in heat (warmup and cooldown return before the detector).

Deviations from heat, each only reachable with non-default settings: with ``warmup_epochs=0``
cycling starts at epoch 0 (heat would never leave its initial blocking mode); the cycle start is
capped at ``max_global_skips``; ``batches_to_wait`` is kept in ``[1, global_skips]`` (heat can
reset to 0, i.e. blocking, when ``max_global_skips < local_skip_factor``, or hold two messages
in flight when ``batches_to_wait > global_skips``). The invariant: at most one message is in
flight, because a message is due no later than the next send step and a step receives before
it sends (``global_skips = batches_to_wait = 1`` receives the previous step's message, then
sends the next).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from hvd_plugins.core.sync.daso.config import DasoConfig

CYCLE_START = (4, 1, 1)
"""heat's ``(global_skips, local_skips, batches_to_wait)`` on entering the cycling phase."""


class Phase(str, Enum):
    """Training phases; warmup and cooldown average gradients over all workers every step."""

    WARMUP = "warmup"
    CYCLING = "cycling"
    COOLDOWN = "cooldown"
    SYNCHRONOUS = "synchronous"
    """An epoch that would cycle, after cycling proved slower than synchronous steps (``decline_cycling``)."""

    @property
    def code(self) -> int:
        """A number for loggers that only take numbers: 0 warmup, 1 cycling, 2 cooldown, 3 synchronous."""
        return list(Phase).index(self)

    @property
    def synchronous(self) -> bool:
        """Gradients averaged over all workers every step: nothing else to sync across nodes."""
        return self is not Phase.CYCLING


@dataclass(frozen=True)
class StepPlan:
    """What the syncer does after one optimizer step, in this order.

    ``receive``: wait for the message in flight and merge it with weight ``2 * merge_wait``
    for the local parameters (skipped as a merge, but still awaited, when ``blocking`` follows,
    because the blocking average of the current parameters supersedes the stale one).
    ``blocking``: average parameters, optimizer state and buffers over all workers now and wait.
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


def improves(loss: float, best: float, threshold: float) -> bool:
    """heat's relative test in mode min: below ``best`` by more than ``threshold`` of it."""
    return loss < (best * (1 - threshold) if best >= 0 else best * (1 + threshold))


@dataclass
class DasoSchedule:
    """The DASO schedule: phase, ``global_skips``, ``local_skips`` and ``batches_to_wait`` per epoch.

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
    local_skips: int = field(default=1, init=False)
    batches_to_wait: int = field(default=0, init=False)
    cycling_declined: bool = field(default=False, init=False)
    """Set by ``decline_cycling``: epochs that would cycle run synchronous instead."""
    best_loss: float = field(default=math.inf, init=False)
    epochs_without_improvement: int = field(default=0, init=False)
    last_plan: StepPlan = field(default_factory=StepPlan, init=False)
    history: list[EpochRecord] = field(default_factory=list, init=False, repr=False)
    _sent_at: int | None = field(default=None, init=False, repr=False)
    _in_flight_wait: int = field(default=0, init=False, repr=False)
    _epoch_closed_blocking: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.total_epochs is not None and self.total_epochs < 1:
            raise ValueError(f"total_epochs={self.total_epochs!r} must be >= 1 or None (unknown length)")
        self._enter(self.phase_of(0), previous=None)

    # ------------------------------------------------------------------ queries
    def phase_of(self, epoch: int) -> Phase:
        """The phase epoch ``epoch`` (0-based) runs in; warmup wins when both overlap."""
        if epoch < self.config.warmup_epochs:
            return Phase.WARMUP
        if self.total_epochs is not None and epoch >= self.total_epochs - self.config.cooldown_epochs:
            return Phase.COOLDOWN
        return Phase.SYNCHRONOUS if self.cycling_declined else Phase.CYCLING

    def decline_cycling(self) -> None:
        """From the next epoch on, epochs that would cycle run synchronous (cycling did not pay on this link).

        Call between an epoch's last step and ``end_epoch``; the epoch running now keeps its phase."""
        self.cycling_declined = True

    @property
    def settings(self) -> tuple[int, int, int]:
        """heat's ``(global_skips, local_skips, batches_to_wait)`` of the current epoch."""
        return self.global_skips, self.local_skips, self.batches_to_wait

    @property
    def in_flight(self) -> bool:
        return self._sent_at is not None

    def is_sync_step(self, step_in_epoch: int) -> bool:
        """Whether the ``step_in_epoch``-th optimizer step (1-based) starts a cross-node sync."""
        return not self.phase.synchronous and step_in_epoch % self.global_skips == 0

    def receive_due(self, step_in_epoch: int) -> bool:
        """Whether the message in flight is due at the ``step_in_epoch``-th step."""
        return self._sent_at is not None and step_in_epoch - self._sent_at >= self._in_flight_wait

    # ------------------------------------------------------------------ transitions
    def on_optimizer_step(self, last_batch_of_epoch: bool) -> StepPlan:
        """Advance one optimizer step and say what to communicate after it.

        Synchronous phases communicate nothing here (their gradients were averaged over all
        workers). Cycling receives before it sends, and blocks on the epoch's last batch.
        """
        self.step_in_epoch += 1
        step = self.step_in_epoch
        if self.phase.synchronous:
            self.last_plan = StepPlan()
            return self.last_plan
        receive = self.receive_due(step) or (last_batch_of_epoch and self.in_flight)
        blocking = last_batch_of_epoch
        send = self.is_sync_step(step) and not blocking
        plan = StepPlan(receive=receive, blocking=blocking, send=send, merge_wait=self._in_flight_wait)
        if receive:
            self._sent_at = None
        if send:
            self._sent_at, self._in_flight_wait = step, self.batches_to_wait
        self._epoch_closed_blocking = blocking
        self.last_plan = plan
        return plan

    def finish_epoch(self) -> StepPlan:
        """What a cycling epoch still owes when it is over: the message in flight, a closing blocking sync.

        Usually nothing, because the last batch already synced; it matters when the last batch
        did not step the optimizer (or the loop stopped early), so every epoch ends with all
        workers holding the same parameters. Synchronous epochs owe nothing.
        """
        if self.phase.synchronous:
            return StepPlan()
        plan = StepPlan(receive=self.in_flight, blocking=not self._epoch_closed_blocking)
        self._sent_at = None
        self._epoch_closed_blocking = True
        if plan.communicates:
            self.last_plan = plan
        return plan

    def end_epoch(self, loss: float | None) -> EpochRecord:
        """Record the epoch's loss (mean over all workers) and choose the next epoch's settings.

        ``loss=None`` (or NaN) means no loss was seen: the phase still advances, the detector
        does not count the epoch. Returns the record of the epoch that just ended.
        """
        if self.in_flight:
            raise RuntimeError("end_epoch() with a cross-node message still in flight; call finish_epoch() first")
        value = None if loss is None or not math.isfinite(loss) else float(loss)
        record = EpochRecord(self.epoch, self.phase, self.global_skips, self.batches_to_wait, value)
        self.history.append(record)
        previous = self.phase
        self.epoch += 1
        self.step_in_epoch = 0
        self._epoch_closed_blocking = False
        following = self.phase_of(self.epoch)
        self._enter(following, previous)
        if following is Phase.CYCLING and value is not None and self._plateau(value):
            self._shrink_or_reset()
        return record

    def _plateau(self, loss: float) -> bool:
        """heat's DetectMetricPlateau: True on the ``stable_epochs + 1``-th non-improving epoch in a row."""
        if improves(loss, self.best_loss, self.config.stability_level):
            self.best_loss = loss
            self.epochs_without_improvement = 0
            return False
        self.epochs_without_improvement += 1
        if self.epochs_without_improvement > self.config.stable_epochs:
            self.epochs_without_improvement = 0
            return True
        return False

    def _shrink_or_reset(self) -> None:
        factor = self.config.skip_reduction_factor
        if self.global_skips > 1:
            self._set(self.global_skips // factor, self.local_skips // factor, self.batches_to_wait - 1)
        else:
            reset = self.config.max_global_skips // self.config.local_skip_factor
            self._set(self.config.max_global_skips, reset, reset)

    def _enter(self, phase: Phase, previous: Phase | None) -> None:
        """Set the phase; a synchronous phase is (1, 1, 0); entering cycling starts at CYCLE_START."""
        self.phase = phase
        if phase.synchronous:
            self.global_skips, self.local_skips, self.batches_to_wait = 1, 1, 0
        elif previous is not Phase.CYCLING:
            global_skips, local_skips, batches_to_wait = CYCLE_START
            self._set(min(global_skips, self.config.max_global_skips), local_skips, batches_to_wait)

    def _set(self, global_skips: int, local_skips: int, batches_to_wait: int) -> None:
        """Cycling settings: every value at least 1, and at most one message in flight."""
        self.global_skips = max(1, global_skips)
        self.local_skips = max(1, local_skips)
        self.batches_to_wait = min(max(1, batches_to_wait), self.global_skips)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Where the schedule stands between epochs, for checkpoints (``best_loss`` None: none yet)."""
        return {
            "epoch": self.epoch,
            "phase": self.phase.value,
            "global_skips": self.global_skips,
            "local_skips": self.local_skips,
            "batches_to_wait": self.batches_to_wait,
            "best_loss": None if math.isinf(self.best_loss) else self.best_loss,
            "epochs_without_improvement": self.epochs_without_improvement,
            "cycling_declined": self.cycling_declined,
            "history": [{**asdict(record), "phase": record.phase.value} for record in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.cycling_declined = bool(state.get("cycling_declined", False))
        self._enter(Phase(state["phase"]), previous=None)
        if not self.phase.synchronous:
            self._set(int(state["global_skips"]), int(state.get("local_skips", 1)), int(state["batches_to_wait"]))
        self.best_loss = math.inf if state["best_loss"] is None else float(state["best_loss"])
        self.epochs_without_improvement = int(state["epochs_without_improvement"])
        self.history = [EpochRecord(**{**record, "phase": Phase(record["phase"])}) for record in state["history"]]
        self.step_in_epoch = 0
        self._sent_at = None
        self._epoch_closed_blocking = False
        # A resumed run may be given another length or warmup: re-derive the phase from them.
        if self.phase_of(self.epoch) is not self.phase:
            self._enter(self.phase_of(self.epoch), previous=self.phase)
