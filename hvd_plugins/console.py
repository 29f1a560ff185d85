"""What a Horovod job prints: one progress display and one copy of each warning, from rank 0.

horovodrun prefixes each line of each worker with ``[rank]<stdout>:`` or ``[rank]<stderr>:``. There,
tqdm's carriage-return redraws glue into a few huge lines, and every rank repeats the same
warnings. So under a launcher (or with stdout not a terminal) Lightning's default bar becomes a
``LineProgressBar``, and ranks other than 0 stop displaying Python warnings.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from hvd_plugins.callbacks.progress import LineProgressBar
from hvd_plugins.environment import HorovodEnvironment, launcher_rank

ALL_RANK_WARNINGS_ENV = "HVD_PLUGINS_ALL_RANK_WARNINGS"
"""Set to ``1`` to see Python warnings from every rank, as without this package."""

_ShowWarning = Callable[..., None]
_shown_before: _ShowWarning | None = None
"""``warnings.showwarning`` as it was before ranks other than 0 were silenced (None: not silenced)."""


def _drop_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Display nothing: rank 0 shows the same warning."""


def follow_rank(rank: int) -> None:
    """Make Lightning's rank-zero output and Python's warnings appear on rank 0 only.

    Only the display of warnings is dropped: a warning turned into an error (``-W error``) still
    raises on every rank, and exceptions print as before.
    """
    global _shown_before
    rank_zero_only.rank = rank
    quiet = rank > 0 and os.environ.get(ALL_RANK_WARNINGS_ENV) != "1"
    if quiet and _shown_before is None:
        _shown_before, warnings.showwarning = warnings.showwarning, _drop_warning
    elif not quiet and _shown_before is not None:
        warnings.showwarning, _shown_before = _shown_before, None


def follow_launcher_rank() -> None:
    """At import, before Horovod starts: take the rank the launcher gave this process, if any.

    Lightning reads only torch-style variables (``RANK``...), so before the Trainer exists every
    Horovod worker believes it is rank 0 and prints rank-zero messages.
    """
    rank = launcher_rank()
    if rank is not None:
        follow_rank(rank)


def _given_callbacks(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    return [callbacks] if isinstance(callbacks, Callback) else list(callbacks)


def progress_bar_given_to_trainer() -> bool | None:
    """Whether the ``Trainer`` being built was given a progress bar in ``callbacks``.

    Called from a strategy hook that runs inside ``Trainer.__init__`` (``set_world_ranks``), before
    Lightning adds its default bar, which is otherwise indistinguishable from a ``TQDMProgressBar()``
    the user passed. None when no ``Trainer.__init__`` is on the call stack.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), Trainer):
                return any(isinstance(c, ProgressBar) for c in _given_callbacks(frame.f_locals.get("callbacks")))
            frame = frame.f_back
        return None
    finally:
        del frame  # frames hold their locals: do not keep the Trainer's alive


def tqdm_reads_badly(world_size: int) -> bool:
    """Under a launcher, or with stdout piped to a file: carriage returns do not redraw there."""
    return world_size > 1 or HorovodEnvironment.detect() or not sys.stdout.isatty()


def use_line_progress_bar(trainer: Trainer, bar_given: bool | None, world_size: int) -> bool:
    """Swap Lightning's default ``TQDMProgressBar`` for a ``LineProgressBar`` where tqdm reads badly.

    A bar the user passed (``bar_given``; None means unknown) is never replaced, nor a subclass of
    tqdm's; ``enable_progress_bar=False`` leaves no bar to replace. Returns whether it swapped.
    """
    bar = trainer.progress_bar_callback
    if bar_given is not False or type(bar) is not TQDMProgressBar or not tqdm_reads_badly(world_size):
        return False
    trainer.callbacks[trainer.callbacks.index(bar)] = LineProgressBar()
    return True
