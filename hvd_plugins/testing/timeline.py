"""Reading Horovod's timeline: where a collective's time went, and how many rounds the loop ran.

Horovod writes a Chrome trace (``HOROVOD_TIMELINE=<file>``, rank 0 only): every collective is a
``pid`` whose phases nest as begin/end events (``NEGOTIATE_ALLREDUCE`` from enqueue until every worker
has it ready, then ``ALLREDUCE`` holding the fusion copies and ``GLOO_ALLREDUCE``), and with
``HOROVOD_TIMELINE_MARK_CYCLES=1`` every round of the background loop is a ``CYCLE_START`` mark.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PHASES = {
    "negotiate": ("NEGOTIATE_ALLREDUCE",),
    "copies": ("MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"),
    "ring": ("GLOO_ALLREDUCE", "MPI_ALLREDUCE"),
}
"""The phases summed per step, by the names Horovod gives them."""


def read_timeline(path: Path) -> list[dict[str, Any]]:
    """A timeline's events; a file its job left unclosed is closed first."""
    text = path.read_text().strip().rstrip(",")
    return list(json.loads(text if text.endswith("]") else text + "]"))


def phase_spans(events: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    """``(name, start us, end us)`` of every phase that began and ended; each collective nests its own."""
    open_spans: dict[int, list[tuple[str, int]]] = {}
    spans = []
    for event in events:
        if event.get("ph") == "B":
            open_spans.setdefault(event["pid"], []).append((event["name"], event["ts"]))
        elif event.get("ph") == "E" and open_spans.get(event["pid"]):
            name, start = open_spans[event["pid"]].pop()
            spans.append((name, start, event["ts"]))
    return spans


def allreduce_breakdown(events: list[dict[str, Any]], steps: int) -> dict[str, float]:
    """Per training step: rounds, allreduces, and milliseconds of each of ``PHASES``.

    The window runs from the first allreduce's enqueue to the last one's end: from the first step's
    backward to the last step's, ``steps - 1`` whole steps (``steps`` allreduce rounds of buckets).
    """
    if steps < 2:
        raise ValueError(f"steps={steps}: the window between the first and the last step needs at least 2")
    spans = phase_spans(events)
    negotiated = [start for name, start, _ in spans if name == "NEGOTIATE_ALLREDUCE"]
    finished = [(start, end) for name, start, end in spans if name == "ALLREDUCE"]
    if not negotiated or not finished:
        raise ValueError("the timeline holds no allreduce")
    first, last = min(negotiated), max(end for _, end in finished)
    cycles = sum(1 for event in events if event.get("name") == "CYCLE_START" and first <= event["ts"] <= last)
    breakdown = {"rounds": cycles / (steps - 1), "allreduces": len(finished) / steps}
    for phase, names in PHASES.items():
        spent = sum(end - start for name, start, end in spans if name in names and first <= start <= last)
        breakdown[phase] = spent / 1000 / (steps - 1)
    return breakdown
