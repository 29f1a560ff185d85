from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvd_plugins.testing.timeline import allreduce_breakdown, phase_spans, read_timeline


def collective(pid: int, start: int, ready: int, copy: int, ring: int) -> list[dict]:
    """One allreduce as Horovod writes it: negotiation, then the op with a copy in and the ring (us)."""
    return [
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": start, "pid": pid},
        {"ph": "E", "ts": ready, "pid": pid},
        {"ph": "B", "name": "ALLREDUCE", "ts": ready, "pid": pid},
        {"ph": "B", "name": "MEMCPY_IN_FUSION_BUFFER", "ts": ready, "pid": pid},
        {"ph": "E", "ts": ready + copy, "pid": pid},
        {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": ready + copy, "pid": pid},
        {"ph": "E", "ts": ready + copy + ring, "pid": pid},
        {"ph": "E", "ts": ready + copy + ring, "pid": pid},
    ]


def test_a_run_of_three_steps_is_summed_per_step(tmp_path: Path) -> None:
    rounds = [{"ph": "i", "name": "CYCLE_START", "ts": ts, "s": "g"} for ts in (0, 1000, 1500, 3000, 9000)]
    events = [*collective(1, 1000, 3000, 200, 1000), *collective(2, 5000, 6000, 0, 2000), *rounds]
    events += collective(3, 7000, 7500, 100, 500)  # ends at 8100: the rounds at 0 and 9000 are outside
    path = tmp_path / "timeline.json"
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + ",")  # unclosed, as a killed job leaves it
    assert read_timeline(path) == events
    assert ("GLOO_ALLREDUCE", 3200, 4200) in phase_spans(events)
    breakdown = allreduce_breakdown(read_timeline(path), steps=3)
    assert breakdown == pytest.approx(
        {"rounds": 3 / 2, "allreduces": 1.0, "negotiate": 3.5 / 2, "copies": 0.3 / 2, "ring": 3.5 / 2}
    )


def test_too_few_steps_or_no_allreduce_are_refused() -> None:
    with pytest.raises(ValueError, match="steps=1"):
        allreduce_breakdown(collective(1, 0, 10, 0, 10), steps=1)
    with pytest.raises(ValueError, match="no allreduce"):
        allreduce_breakdown([{"ph": "i", "name": "CYCLE_START", "ts": 0}], steps=4)
