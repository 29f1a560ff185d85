"""The hosts of a Slurm allocation in horovodrun's ``-H host:slots,...`` form.

horovodrun knows nothing of Slurm; inside ``sbatch``/``salloc`` its host list comes from the
allocation: ``SLURM_JOB_NODELIST`` (compressed, expanded by ``scontrol show hostnames``) and
``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``: two tasks on each of three nodes, then one).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping


def tasks_per_node(spec: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"SLURM_TASKS_PER_NODE={spec!r} is not of the form '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """``"node[01-03]"`` -> ``["node01", "node02", "node03"]``, by ``scontrol show hostnames``."""
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"scontrol show hostnames {nodelist} failed: {done.stderr.strip()}")
    return done.stdout.split()


def horovodrun_hosts(environ: Mapping[str, str] = os.environ) -> str:
    """``host:slots,...`` for ``horovodrun -H`` from the allocation this process runs in."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    spec = environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not spec:
        raise RuntimeError(
            "not inside a Slurm allocation with tasks (SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE are unset); "
            "run this in an sbatch script or salloc with --ntasks or --ntasks-per-node"
        )
    hosts, counts = expand_nodelist(nodelist), tasks_per_node(spec)
    if len(hosts) != len(counts):
        raise RuntimeError(f"{len(hosts)} hosts in {nodelist!r} but {len(counts)} task counts in {spec!r}")
    return ",".join(f"{host}:{count}" for host, count in zip(hosts, counts, strict=True))
