"""torch's threads per worker: the host's cores shared among its workers unless the user chose."""

from __future__ import annotations

from hvd_plugins import HorovodStrategy
from hvd_plugins.core.cpu_threads import choose_cpu_threads


def test_cpu_threads_share_the_host_unless_the_user_chose() -> None:
    assert choose_cpu_threads("auto", workers_on_host=4, cpus=16, environ={}) == 4
    assert choose_cpu_threads("auto", workers_on_host=4, cpus=2, environ={}) == 1  # never below one
    assert choose_cpu_threads("auto", workers_on_host=1, cpus=16, environ={}) is None  # alone: torch's default
    assert choose_cpu_threads("auto", workers_on_host=4, cpus=16, environ={"OMP_NUM_THREADS": "8"}) is None
    assert choose_cpu_threads(3, workers_on_host=4, cpus=16, environ={"OMP_NUM_THREADS": "8"}) == 3
    assert choose_cpu_threads(None, workers_on_host=4, cpus=16, environ={}) is None
    assert "cpu_threads" not in HorovodStrategy(cpu_threads=2).config.fingerprint()  # hosts may differ
