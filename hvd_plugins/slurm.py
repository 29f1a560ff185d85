"""Command-line helpers for Slurm jobs.

``python -m hvd_plugins.slurm hosts`` prints the allocation as ``host:slots,...``, for::

    horovodrun -np "$SLURM_NTASKS" -H "$(python -m hvd_plugins.slurm hosts)" python train.py
"""

from __future__ import annotations

import argparse
import sys

from hvd_plugins.core.backend.slurm_hosts import horovodrun_hosts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_plugins.slurm", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["hosts"], help="hosts: the allocation in horovodrun's -H form")
    parser.parse_args(argv)
    try:
        print(horovodrun_hosts())
    except (RuntimeError, ValueError) as error:
        print(f"hvd_plugins.slurm: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
