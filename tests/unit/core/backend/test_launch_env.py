"""What a launcher told the process: its rank."""

from __future__ import annotations

import pytest

from hvd_plugins.core.backend.launch_env import launcher_rank


def test_launcher_rank_is_read_from_the_launchers_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launcher_rank() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert launcher_rank() == 3
