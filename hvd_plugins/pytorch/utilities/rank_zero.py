"""One copy of each message from a Horovod job: Lightning's rank-zero output and Python's warnings on rank 0 only.

horovodrun prefixes each line of each worker with ``[rank]<stdout>:``; without this every rank
repeats the same warnings, and before the Trainer exists every worker believes it is rank 0.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TextIO

from lightning.pytorch.utilities.rank_zero import rank_zero_only

from hvd_plugins.core.backend.launch_env import launcher_rank

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
    rank_zero_only.rank = rank  # type: ignore[attr-defined]  # Lightning's own way
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
