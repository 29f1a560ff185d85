"""Share a host's cores among the Horovod workers on it, as ``torchrun`` does.

Every torch process starts with one intra-op thread per core. With several workers on one host,
each of them does, so N workers run N times as many compute threads as there are cores; OpenMP
threads that wait spin, and they preempt each other (docs/measurements.rst, "Threads per worker").
``OMP_NUM_THREADS`` in the environment always wins: it is what the user (or a launcher) chose.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

AUTO = "auto"


def validate_cpu_threads(value: object) -> int | str | None:
    """``"auto"``, ``None`` (leave torch alone) or a positive whole number of threads."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"cpu_threads={value!r} must be 'auto', None or a whole number of threads >= 1")
    return value


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, which containers and launchers may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_worker(cpus: int, workers_on_host: int) -> int:
    """Each worker's fair share of the host's cores, at least one."""
    return max(1, cpus // max(1, workers_on_host))


def choose_cpu_threads(
    setting: int | str | None, workers_on_host: int, cpus: int, environ: Mapping[str, str]
) -> int | None:
    """How many intra-op threads torch should use here; None: leave torch's own choice."""
    if setting is None:
        return None
    if setting != AUTO:
        return int(setting)
    if environ.get("OMP_NUM_THREADS") or workers_on_host <= 1:
        return None
    return threads_per_worker(cpus, workers_on_host)


def apply_cpu_threads(setting: int | str | None, workers_on_host: int) -> int | None:
    """Set torch's intra-op threads as ``choose_cpu_threads`` says; returns what was set (None: nothing)."""
    threads = choose_cpu_threads(setting, workers_on_host, usable_cpus(), os.environ)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads
