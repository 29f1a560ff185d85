"""The two-level and DASO sums stay bit for bit what they were: digests of a fixed job against stored ones.

One job of two emulated nodes of two workers (tests/workers/sync_digests.py) computes two-level sums,
trains with ``sync="hierarchical"`` and with ``sync="daso"``, and reports sha256 digests of the results.
They must equal ``tests/data/sync_digests.json``, written from the same job when the digests were
taken. A change in the order of a sum, a wire type or a bucket changes a digest. The digests hold for
the torch they were taken with (another torch may compute the same steps with other roundings): with
another, the test says so and skips. ``HVD_WRITE_SYNC_DIGESTS=1`` writes the file anew (only where a
change of the sums is intended, and said so).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _common import reports_of
from hvd_launch import TWO_NODES, run_job
from sync_digests import check_daso_training, check_hierarchical_training, check_two_level_sums

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.core.comm.backward_buckets",
    "hvd_plugins.core.comm.compression",
    "hvd_plugins.core.comm.cross_node",
    "hvd_plugins.core.comm.partners",
    "hvd_plugins.core.comm.reducer",
    "hvd_plugins.core.comm.two_level",
    "hvd_plugins.core.sync.daso.mode",
    "hvd_plugins.core.sync.daso.parameter_sync",
    "hvd_plugins.core.sync.hierarchical.mode",
)

STORED = Path(__file__).resolve().parent / "data" / "sync_digests.json"
CHECKS = (check_two_level_sums, check_hierarchical_training, check_daso_training)


@pytest.fixture(scope="module")
def digests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    job = run_job("sync_digests.py", np=4, hosts=TWO_NODES, out_dir=tmp_path_factory.mktemp("digests"), timeout=600)
    job.check()
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    found = {}
    for check in CHECKS:
        per_rank = reports_of(job.results, check)
        assert all(report == per_rank[0] for report in per_rank), f"{check.__name__}: ranks differ: {per_rank}"
        found[check.__name__] = per_rank[0]
    if os.environ.get("HVD_WRITE_SYNC_DIGESTS") == "1":
        STORED.write_text(json.dumps({"torch": torch.__version__, "digests": found}, indent=2, sort_keys=True) + "\n")
    return found


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__ for check in CHECKS])
def test_sums_are_bit_for_bit_the_stored_ones(digests: dict[str, dict[str, str]], check: object) -> None:
    stored = json.loads(STORED.read_text())
    if stored["torch"] != torch.__version__:
        pytest.skip(f"the digests were taken with torch {stored['torch']}, this is torch {torch.__version__}")
    name = getattr(check, "__name__", "")
    changed = {
        case: (digest, stored["digests"][name].get(case))
        for case, digest in digests[name].items()
        if digest != stored["digests"][name].get(case)
    }
    assert not changed, f"{name}: these results are no longer bit for bit the stored ones: {sorted(changed)}"
    assert sorted(digests[name]) == sorted(stored["digests"][name])
