"""Fabric's HorovodStrategy at construction: a sync it cannot run is refused, naming what it takes."""

from __future__ import annotations

import pytest


def test_an_unknown_sync_lists_only_what_fabric_takes() -> None:
    from hvd_plugins.fabric import HorovodStrategy

    with pytest.raises(
        ValueError, match=r"^sync='bogus' is not supported with Fabric; choose one of \['allreduce', 'hierarchical'\]$"
    ):
        HorovodStrategy(sync="bogus")
