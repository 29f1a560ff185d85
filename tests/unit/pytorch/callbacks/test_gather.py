"""The tables the monitoring callbacks print."""

from __future__ import annotations

from hvd_plugins.pytorch.callbacks._gather import format_table


def test_format_table_aligns_columns() -> None:
    text = format_table(("name", "value"), [("a", 1.5), ("long name", 1234.0)])
    lines = text.splitlines()
    assert lines[0] == "     name     value"
    assert lines[3] == "long name  1,234.00"
