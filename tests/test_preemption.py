"""A Slurm worker survives a time-limit signal that comes while it starts up (one fresh interpreter per case).

The preemption pieces that need no process of their own: tests/unit/core/faults/test_preemption.py and
tests/unit/pytorch/test_preemption.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("variables", "survives"),
    [
        ({"SLURM_JOB_ID": "5", "PMIX_RANK": "0"}, True),  # a worker srun --mpi=pmix started
        ({"SLURM_JOB_ID": "5"}, False),  # a Slurm job that is no Horovod worker (DDP): Lightning's handling
        ({"PMIX_RANK": "0"}, False),  # MPI outside Slurm: no time-limit warning to expect
    ],
    ids=["horovod-worker-in-slurm", "slurm-without-launcher", "mpi-without-slurm"],
)
def test_importing_the_package_in_a_slurm_worker_survives_an_early_time_limit_warning(
    variables: dict[str, str], survives: bool
) -> None:
    """Slurm may send --signal=USR1@T during start-up: a Horovod worker's import notes it instead of dying."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMIX_", "PMI_", "OMPI_", "HOROVOD_"))}
    env.update(variables)
    # only the signal part of the import: a PMIX_RANK makes importing Horovod try to start MPI
    code = (
        "import os, signal\n"
        "from hvd_plugins.core.faults.preemption import note_early_warning_signal\n"
        "note_early_warning_signal(); os.kill(os.getpid(), signal.SIGUSR1); print('alive')"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if survives:
        assert done.returncode == 0 and "alive" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode == -signal.SIGUSR1
