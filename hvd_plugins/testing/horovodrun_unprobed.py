"""``horovodrun`` without its per-launch build probe, for drivers that launch many short jobs.

    python horovodrun_unprobed.py -np 2 -H localhost:2 --gloo python worker.py   # same arguments as horovodrun

Before every ``--gloo`` launch horovodrun forks a process that imports ``horovod.torch`` (so torch)
only to ask whether Gloo was built: about 1.5 CPU-seconds and 2-3 s of wall time per job on a small
machine, before any worker starts. This runs Horovod's own ``horovodrun`` entry point with that
answer given instead (for ``--mpi``, that MPI was built). The driver must have checked the build
once (``gloo_built()`` or ``mpi_built()`` in a process that imports Horovod anyway); the launched
workers, their environment and the rendezvous are horovodrun's, unchanged. Run as a script (never
imported): it must not import ``hvd_plugins``, whose package import loads Lightning.
"""

from __future__ import annotations

import sys


def main() -> int | None:
    from horovod.runner import launch

    launch.gloo_built = lambda verbose=False: True
    launch.mpi_built = lambda verbose=False: True  # checked by the driver for --mpi
    sys.argv[0] = "horovodrun"
    return launch.run_commandline()


if __name__ == "__main__":
    sys.exit(main())
