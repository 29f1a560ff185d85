"""HorovodTimeline's recording window."""

from __future__ import annotations

import pytest

from hvd_plugins.pytorch.callbacks import HorovodTimeline


def test_timeline_rejects_an_empty_window() -> None:
    with pytest.raises(ValueError, match="start_step=5, stop_step=5"):
        HorovodTimeline("t.json", start_step=5, stop_step=5)
    with pytest.raises(ValueError, match="start_step=-1"):
        HorovodTimeline("t.json", start_step=-1, stop_step=3)
