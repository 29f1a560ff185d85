"""The repository's one plain-text table layout: the callbacks' rank-0 tables and the benchmarks' reports.

Right-aligned columns under a dashed rule read the same in a terminal, a worker's log and a
committed ``.txt`` report, and cost no dependency the package does not already have.
"""

from __future__ import annotations

from collections.abc import Sequence


def format_cell(value: object, decimals: int | None = None) -> str:
    """One cell: integers with thousands separators; floats to ``decimals`` places, or 3 significant digits.

    Three significant digits suit measured rates and times (their noise is larger); a fixed number
    of decimals suits columns of like quantities (MiB, seconds) that are read against each other.
    """
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if decimals is not None:
            return f"{value:,.{decimals}f}"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def format_table(headers: Sequence[object], rows: Sequence[Sequence[object]], *, decimals: int | None = None) -> str:
    """Right-aligned columns, a dashed rule under the headers; cells as ``format_cell`` writes them."""
    cells = [[str(header) for header in headers]] + [[format_cell(value, decimals) for value in row] for row in rows]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
