"""Every DASO check of one topology in ONE horovodrun job; each check reported by name.

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python tests/workers/daso_checks.py --out DIR --case two_by_two
    horovodrun -np 2 -H localhost:1,127.0.0.1:1 --gloo python tests/workers/daso_checks.py --out DIR --case two_by_one

Every rank runs the same checks in the same order and writes ``rank<N>.json``. Both jobs start
Horovod as Horovod's docs do (plain ``hvd.init()``) before any Trainer exists; the strategy keeps
that start (DASO reaches its partners through global alltoalls, no process sets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
from _common import parse_out, run_checks, write_result
from daso_resume import resume_matches_uninterrupted
from daso_training import (
    check_closing_average,
    check_merge_weight,
    fit,
    refuses_iterable_without_length,
)
from finetuning import UnfreezeExtra
from models import MlpClassifier, TwoOptimizerClassifier

CYCLING = {"warmup_epochs": 1, "cooldown_epochs": 1, "stable_epochs": 2}
SGD_BYTES = {"optimizer": "sgd", "batchnorm": False, "epochs": 2}


def two_by_two_checks() -> dict[str, Callable[[], Any]]:
    return {
        "merge_weight": check_merge_weight,
        "closing_average": check_closing_average,
        "daso_adam_fp16": lambda: fit("daso", epochs=5, daso=CYCLING),
        "allreduce_adam": lambda: fit("allreduce", epochs=5),
        "daso_sgd_fp16": lambda: fit("daso", daso={"cooldown_epochs": 0, "warmup_epochs": 1}, **SGD_BYTES),
        "daso_sgd_fp32": lambda: fit(
            "daso", daso={"cooldown_epochs": 0, "warmup_epochs": 1, "downcast": "fp32"}, **SGD_BYTES
        ),
        "allreduce_sgd": lambda: fit("allreduce", **SGD_BYTES),
    }


def two_by_one_checks(out: Any) -> dict[str, Callable[[], Any]]:
    return {
        "resume": lambda: resume_matches_uninterrupted(out),
        "merge_weight": check_merge_weight,
        "closing_average": check_closing_average,
        # a layer only node 0 uses: node 1 must still get its Adam state (zero-filled gradients)
        "daso": lambda: fit(
            "daso",
            epochs=3,
            daso=CYCLING,
            batches=12,
            accumulate=2,
            model=MlpClassifier("adam", True, node_zero_branch=True),
        ),
        "two_optimizers": lambda: fit("daso", epochs=3, daso=CYCLING, model=TwoOptimizerClassifier()),
        "unfreeze": lambda: fit(
            "daso",
            epochs=4,
            daso={"warmup_epochs": 1, "cooldown_epochs": 1},
            model=MlpClassifier("adam", True, frozen_extra=True),
            callbacks=[UnfreezeExtra(new_group=True, epoch=2)],
        ),
        "iterable_without_length": refuses_iterable_without_length,  # last: the fit stops with an error
    }


def main() -> None:
    out, args = parse_out()
    if args.case == "two_by_two":
        hvd.init()  # plain, as users start; the strategy keeps it
        checks = two_by_two_checks()
    else:
        hvd.init()  # as Horovod's docs start a script; the strategy keeps it
        checks = two_by_one_checks(out)
    report = run_checks(checks)
    write_result(out, hvd.rank(), {"checks": report, "cross_rank": hvd.cross_rank()})


if __name__ == "__main__":
    main()
