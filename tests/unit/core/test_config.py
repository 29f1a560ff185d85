"""HorovodConfig: settings that cannot work together are refused, naming them."""

from __future__ import annotations

import pytest

from hvd_plugins.core.config import HorovodConfig


def test_gradient_predivide_factor_and_adasum_are_refused_with_daso() -> None:
    with pytest.raises(ValueError, match="gradient_predivide_factor=2.0 works only with sync='allreduce'"):
        HorovodConfig(sync="daso", gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="op='adasum' works only with sync='allreduce'"):
        HorovodConfig(sync="daso", op="adasum")
