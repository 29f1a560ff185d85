"""What a launcher (horovodrun, mpirun, srun) told this process before Horovod starts."""

from __future__ import annotations

import os
from collections.abc import Mapping

LAUNCH_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
"""Set for every worker by horovodrun (Gloo launch) or an MPI launcher: the worker's global rank."""


def launcher_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """The global rank the launcher gave this process, known before Horovod starts; None without a launcher."""
    for name in LAUNCH_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def launched_by_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True inside a worker started by horovodrun or an MPI launcher."""
    return any(name in environ for name in LAUNCH_VARIABLES)
