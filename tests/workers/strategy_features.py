"""Lightning features under HorovodStrategy, checked against single-process references: the one job of two
workers on one node that tests/test_strategy_multiprocess.py, tests/test_faults.py, tests/test_adasum.py and
tests/test_pytorch_lightning.py share, under ``horovodrun -np 2``.

The checks live by feature in strategy_gradients.py, strategy_loops.py, strategy_optimizers.py,
strategy_batchnorm.py and compile_checks.py, then faults_checks.py; with ``--adasum`` (under the MPI
controller) Adasum's (adasum_checks.py) run too. Every rank runs every check in the same order and writes
its report, each check under its function's name, to ``--out/rank<r>.json``; ``--case`` runs only the
named ones.
"""

from __future__ import annotations

import sys

import adasum_checks
import compile_checks
import faults_checks
import horovod.torch as hvd
import strategy_batchnorm
import strategy_gradients
import strategy_loops
import strategy_optimizers
from _common import Checks, parse_out, write_result

JOB = Checks(
    strategy_gradients.checks,
    strategy_loops.checks,
    strategy_optimizers.checks,
    strategy_batchnorm.checks,
    compile_checks.checks,
    faults_checks.checks,
)
"""The job's checks but the last (and Adasum's)."""


def job(adasum: bool) -> Checks:
    """Every check of the job, in order: Adasum's need the MPI controller; the bounded one comes last, so
    that if it hangs the checks before it are still reported."""
    return Checks(JOB, *([adasum_checks.checks] if adasum else []), strategy_batchnorm.last)


if __name__ == "__main__":
    out, args = parse_out()
    hvd.init()
    report = (
        job(adasum="--adasum" in sys.argv)
        .selected(args.case)
        .run(on_time_limit=lambda partial: write_result(out, hvd.rank(), partial))
    )
    write_result(out, hvd.rank(), report)
