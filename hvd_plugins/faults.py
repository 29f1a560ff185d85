"""What happens when a worker fails, stalls or produces garbage: bounded, identical on every rank, and said clearly.

Horovod's launcher already ends the whole job when a worker exits non-zero (it is killed, or it
raises): it terminates the other workers (SIGTERM, then SIGKILL after 5 s). What it does not
bound is a worker that stays alive but never joins a collective: the others wait forever unless
Horovod's stall inspector is told to shut down. This module sets that bound, checks that
gradients are finite with one decision shared by all ranks, and reports failures per rank.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from hvd_plugins._horovod import horovod_torch
from hvd_plugins.comm.parameters import indexed_optimizer_parameters, optimizer_parameters

STALL_CHECK_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
STALL_SHUTDOWN_ENV = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
STALL_DISABLE_ENV = "HOROVOD_STALL_CHECK_DISABLE"
HOROVOD_DEFAULT_STALL_CHECK_SECONDS = 60


# ---------------------------------------------------------------------------- stalls
DEFAULT_STALL_TIMEOUT_SECONDS = 1800
"""30 minutes, as torch.distributed's default: far above a checkpoint write or a slow first batch."""


def validate_stall_timeout(seconds: Any, environ: Mapping[str, str] = os.environ) -> int | None:
    """The stall timeout in whole seconds (Horovod reads integers), or None to wait forever.

    ``"auto"`` (the strategy's default) takes horovodrun's ``--stall-check-shutdown-time-seconds``
    (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``) when it was given, waits forever under
    ``--no-stall-check``, and is ``DEFAULT_STALL_TIMEOUT_SECONDS`` otherwise.
    """
    if seconds == "auto":
        if environ.get(STALL_DISABLE_ENV, "0").strip() not in ("", "0"):
            return None
        from_launcher = environ.get(STALL_SHUTDOWN_ENV, "").strip()
        if from_launcher in ("", "0"):
            return DEFAULT_STALL_TIMEOUT_SECONDS
        try:
            return validate_stall_timeout(float(from_launcher))
        except ValueError:
            raise ValueError(
                f"{STALL_SHUTDOWN_ENV}={from_launcher!r} must be a number of seconds >= 1 (or 0 for the default)"
            ) from None
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 1:
        raise ValueError(
            f"stall_timeout_seconds={seconds!r} must be a number of seconds >= 1, 'auto' (horovodrun's "
            f"--stall-check-shutdown-time-seconds, else {DEFAULT_STALL_TIMEOUT_SECONDS} s) or None (wait forever)"
        )
    return math.ceil(seconds)


def stall_environment(timeout_seconds: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The Horovod variables that make a collective missing on some rank end the job after ``timeout_seconds``.

    Horovod ignores a shutdown time shorter than its check interval, so the interval is lowered
    to the timeout when needed (a smaller interval the user set is kept).
    """
    interval = int(environ.get(STALL_CHECK_ENV, HOROVOD_DEFAULT_STALL_CHECK_SECONDS))
    return {STALL_CHECK_ENV: str(max(1, min(interval, timeout_seconds))), STALL_SHUTDOWN_ENV: str(timeout_seconds)}


def apply_stall_timeout(timeout_seconds: int | None, horovod_initialized: bool) -> None:
    """Export the stall variables for Horovod's own stall inspector, which reads them in ``hvd.init()``.

    When a script started Horovod itself, its inspector keeps the settings it started with; the
    bound still holds, because ``CollectiveWatchdog`` enforces it in the package's own waits.
    """
    if timeout_seconds is None or horovod_initialized:
        return
    if os.environ.get(STALL_DISABLE_ENV, "0").strip() not in ("", "0"):
        raise ValueError(
            f"stall_timeout_seconds={timeout_seconds} cannot work while {STALL_DISABLE_ENV}="
            f"{os.environ[STALL_DISABLE_ENV]!r} switches Horovod's stall inspector off; unset one of them"
        )
    os.environ.update(stall_environment(timeout_seconds, os.environ))


STALL_EXIT_CODE = 75


class CollectiveWatchdog:
    """End this worker when it has waited in one collective for longer than ``timeout_seconds``.

    Horovod's stall inspector did not fire under the Gloo controller in our runs (no warning, no
    shutdown, with a 3 s check time, after 150 s), so the bound is kept here: a daemon thread
    watches the collective the training loop is waiting in and, past the timeout, reports and
    exits with ``STALL_EXIT_CODE``. horovodrun then terminates the other workers, including the
    stalled one. Exiting from the thread (``os._exit``) is deliberate: the main thread is blocked
    inside Horovod and cannot unwind.
    """

    def __init__(self, timeout_seconds: int, rank: int, size: int) -> None:
        self.timeout_seconds = timeout_seconds
        self._rank, self._size = rank, size
        self._waiting_for: str | None = None
        self._since = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="hvd_plugins-collective-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Mark the wait for one collective; nothing is held between collectives."""
        with self._lock:
            self._waiting_for, self._since = what, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._waiting_for = None

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_seconds / 4)
        while True:
            time.sleep(interval)
            with self._lock:
                what, waited = self._waiting_for, time.monotonic() - self._since
            if what is not None and waited > self.timeout_seconds:
                print(
                    f"hvd_plugins: rank {self._rank} of {self._size} (host {socket.gethostname()}) waited "
                    f"{waited:.0f} s in the {what}, longer than stall_timeout_seconds={self.timeout_seconds}: some "
                    "rank never joined it (it hangs, or runs different code). Ranks that do not report this are "
                    f"the stalled ones. Ending the job (exit code {STALL_EXIT_CODE}).",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(STALL_EXIT_CODE)


# ---------------------------------------------------------------------------- finite gradients
class NonFiniteGradientError(FloatingPointError):
    """Gradients held NaN or Inf; raised with the same message on every rank."""


class FiniteGradientCheck:
    """Stop training at the first step whose gradients are not finite, on every rank at once.

    A tensor hook on every parameter marks this rank when a local (not yet averaged) gradient
    is NaN/Inf; after the average, one allreduce of a ``2 * world_size`` vector tells every rank
    which ranks produced non-finite local gradients and whose averaged gradients are
    non-finite. All ranks see the same vector, so all raise the same error and none is left
    waiting in a collective. An allreduce (not an allgather) keeps it safe next to ``hvd.join``.
    """

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        self._hvd = horovod_torch()
        self._flags: dict[int, Tensor] = {}  # id(optimizer) -> bool scalar: a local gradient was non-finite
        self._handles: list[RemovableHandle] = []
        for optimizer in optimizers:
            parameters = optimizer_parameters(optimizer, trainable_only=True)
            if not parameters:
                continue
            flag = torch.zeros((), dtype=torch.bool, device=parameters[0].device)
            self._flags[id(optimizer)] = flag
            for parameter in parameters:
                self._handles.append(parameter.register_hook(_mark_non_finite(flag)))

    def after_average(self, optimizer: Optimizer, where: str) -> None:
        """Collective on every rank: raise NonFiniteGradientError if any rank saw a non-finite gradient."""
        flag = self._flags.get(id(optimizer))
        if flag is None:
            return
        hvd = self._hvd
        size, rank = hvd.size(), hvd.rank()
        averaged_bad = torch.zeros((), dtype=torch.bool, device=flag.device)
        for parameter in optimizer_parameters(optimizer):
            if parameter.grad is not None:
                averaged_bad.logical_or_(~torch.isfinite(parameter.grad).all())
        votes = torch.zeros(2 * size, dtype=torch.float32)
        votes[rank] = float(flag.item())  # one device sync per step
        votes[size + rank] = float(averaged_bad.item())
        flag.zero_()
        if size > 1:
            votes = hvd.allreduce(votes, op=hvd.Sum, name="hvd_plugins.finite_gradients")
        local_ranks = [r for r in range(size) if votes[r] > 0]
        averaged_ranks = [r for r in range(size) if votes[size + r] > 0]
        if local_ranks or averaged_ranks:
            origin = (
                f"local gradients were NaN/Inf on rank(s) {local_ranks}"
                if local_ranks
                else f"local gradients were finite but their average overflowed on rank(s) {averaged_ranks}"
            )
            raise NonFiniteGradientError(
                f"Non-finite gradients at {where}: {origin} (of {size} worker(s)). Training stopped on every "
                "rank before the optimizer step, so the weights are still finite. Lower the learning rate, clip "
                "gradients, or look at the loss on those ranks; check_finite_gradients=False turns this check off."
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._flags.clear()


def _mark_non_finite(flag: Tensor) -> Any:
    def hook(gradient: Tensor) -> None:
        flag.logical_or_(~torch.isfinite(gradient).all())  # stays on the device: no sync per parameter

    return hook


def require_no_grad_scaler(precision_plugin: Any) -> None:
    """check_finite_gradients and a GradScaler disagree: the scaler skips inf/NaN steps by design."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "check_finite_gradients=True cannot be combined with a GradScaler (precision='16-mixed' on GPU): the "
            "scaler expects occasional inf/NaN gradients and skips those steps, identically on every rank because "
            "gradients are averaged before unscaling. Drop check_finite_gradients, or use precision='bf16-mixed'/32."
        )


# ---------------------------------------------------------------------------- agreement and launch checks
def optimizer_fingerprint(optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """What must be equal on every rank about the optimizers (Horovod wraps each with its own collectives)."""
    return {
        "optimizers": [
            (type(o).__name__, [(group, tuple(p.shape)) for group, _, p in indexed_optimizer_parameters(o)])
            for o in optimizers
        ]
    }


# ---------------------------------------------------------------------------- failure reports
def describe_failure(exception: BaseException, rank: int, size: int, local_rank: int, where: str) -> str:
    """One line naming the rank, its host and what stopped it; ranks that only followed a failure say so."""
    kind = type(exception).__name__
    text = str(exception).strip().splitlines()[0] if str(exception).strip() else ""
    cause = f"{kind}: {text}" if text else kind
    if kind == "HorovodInternalError":
        cause = (
            "a collective was aborted because Horovod shut down; another rank failed, was killed, or missed a "
            f"collective for longer than stall_timeout_seconds (look for 'Missing ranks' above). {cause}"
        )
    who = f"rank {rank} of {size} (host {socket.gethostname()}, local rank {local_rank})"
    return f"hvd_plugins: {who} stopped at {where}: {cause}"


def report_failure(exception: BaseException, rank: int, size: int, local_rank: int, where: str) -> None:
    """Write the failure line to stderr at once, before Lightning's teardown or the launcher's SIGTERM."""
    print(describe_failure(exception, rank, size, local_rank, where), file=sys.stderr, flush=True)
