"""DASO as a sync mode: the reductions it can average with."""

from __future__ import annotations

import pytest

from hvd_plugins.core.sync.daso import DasoConfig
from hvd_plugins.core.sync.daso.mode import DasoGradientSync


def test_daso_gradient_sync_refuses_ops_it_cannot_average() -> None:
    with pytest.raises(ValueError, match="op='min' is not supported with sync='daso'"):
        DasoGradientSync(DasoConfig(), None, None, "min", None)  # type: ignore[arg-type]
