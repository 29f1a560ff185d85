"""CommCounters: windows of what was sent, by scope."""

from __future__ import annotations

from hvd_plugins.core.comm.counters import CommCounters, Scope


def test_counters_window_difference() -> None:
    counters = CommCounters()
    counters.record(Scope.NODE_LOCAL, 100)
    start = counters.snapshot()
    counters.record(Scope.NODE_LOCAL, 50)
    counters.record(Scope.CROSS_NODE, 7, calls=3)
    window = counters.since(start)
    assert (window.node_local_bytes, window.node_local_calls) == (50, 1)
    assert (window.cross_node_bytes, window.cross_node_calls) == (7, 3)
    counters.reset()
    assert counters.as_dict()["node_local_bytes"] == 0
