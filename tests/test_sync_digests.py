"""The two-level and DASO sums stay bit for bit what they were: digests of a fixed job against stored ones.

One job of two emulated nodes of two workers (tests/workers/sync_digests.py) computes two-level sums,
trains with ``sync="hierarchical"`` and with ``sync="daso"``, and reports sha256 digests of the results.
They must equal ``tests/data/sync_digests.json``, written from the same job when the digests were
taken. A change in the order of a sum, a wire type or a bucket changes a digest. The digests hold for
the torch and the processor they were taken with (another torch, or torch and Horovod's kernels on
another processor, compute some steps with other roundings: an AMD EPYC and an Intel Xeon gave
different float16 and Adam digests from the same code), so the file keeps one record per torch and
processor; for a pair it has none, the test says so and skips. ``HVD_WRITE_SYNC_DIGESTS=1`` writes this
pair's record anew (only where a change of the sums is intended, and said so, or for a new machine).

The job runs with Horovod's tensor fusion off (``HOROVOD_FUSION_THRESHOLD=0``). Two allreduces
started together are fused or not depending on when Horovod's background cycle ticks, and over more
than two workers the ring adds an element in another order when it sits elsewhere in a fused buffer:
the digests would then change with the machine's timing, not with the sums.
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

from hvd_plugins.testing.reports import cpu_model

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
    job = run_job(
        "sync_digests.py",
        np=4,
        hosts=TWO_NODES,
        out_dir=tmp_path_factory.mktemp("digests"),
        timeout=600,
        env={"HOROVOD_FUSION_THRESHOLD": "0"},  # fusion depends on timing (see above)
    )
    job.check()
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    found = {}
    for check in CHECKS:
        per_rank = reports_of(job.results, check)
        assert all(report == per_rank[0] for report in per_rank), f"{check.__name__}: ranks differ: {per_rank}"
        found[check.__name__] = per_rank[0]
    if os.environ.get("HVD_WRITE_SYNC_DIGESTS") == "1":
        others = [record for record in stored_records() if (record["torch"], record["cpu"]) != this_machine()]
        mine = {"torch": this_machine()[0], "cpu": this_machine()[1], "digests": found}
        STORED.write_text(json.dumps(sorted([*others, mine], key=lambda r: (r["torch"], r["cpu"])), indent=2) + "\n")
    return found


def this_machine() -> tuple[str, str]:
    return torch.__version__, cpu_model()


def stored_records() -> list[dict]:
    return json.loads(STORED.read_text()) if STORED.exists() else []


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__ for check in CHECKS])
def test_sums_are_bit_for_bit_the_stored_ones(digests: dict[str, dict[str, str]], check: object) -> None:
    records = stored_records()
    stored = next((r for r in records if (r["torch"], r["cpu"]) == this_machine()), None)
    if stored is None:
        taken = "; ".join(f"torch {r['torch']} on {r['cpu']}" for r in records)
        pytest.skip(f"the digests were taken with {taken}; this is torch {this_machine()[0]} on {this_machine()[1]}")
    name = getattr(check, "__name__", "")
    changed = {
        case: (digest, stored["digests"][name].get(case))
        for case, digest in digests[name].items()
        if digest != stored["digests"][name].get(case)
    }
    assert not changed, f"{name}: these results are no longer bit for bit the stored ones: {sorted(changed)}"
    assert sorted(digests[name]) == sorted(stored["digests"][name])
