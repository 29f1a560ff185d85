"""Catch ranks that disagree on their configuration before they deadlock in a collective."""

from __future__ import annotations

from typing import Any

from hvd_plugins.core.backend.module import horovod_torch


def assert_ranks_agree(fingerprint: dict[str, Any]) -> None:
    """Gather every rank's fingerprint and raise on every rank if any differs from rank 0's.

    One allgather of small pickled dicts; all ranks see the same data, so all raise the same
    error and none is left waiting.
    """
    hvd = horovod_torch()
    if hvd.size() == 1:
        return
    everyone: list[dict[str, Any]] = hvd.allgather_object(fingerprint, name="hvd_plugins.core.backend.agreement")
    reference = everyone[0]
    problems = []
    for rank, theirs in enumerate(everyone[1:], start=1):
        for key in sorted(set(reference) | set(theirs)):
            if reference.get(key) != theirs.get(key):
                problems.append(
                    f"rank {rank} has {key}={_short(theirs.get(key))} but rank 0 has {_short(reference.get(key))}"
                )
    if problems:
        raise ValueError(
            "Horovod workers disagree on their configuration, which would deadlock the first collective: "
            + "; ".join(problems[:8])
            + ("; ..." if len(problems) > 8 else "")
        )


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
