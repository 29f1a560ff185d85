"""Every DASO check of one topology in ONE horovodrun job; each check reported under its function's name.

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python tests/workers/daso_checks.py --out D --topology two_by_two
    horovodrun -np 2 -H localhost:1,127.0.0.1:1 --gloo python tests/workers/daso_checks.py --out D --topology two_by_one

Every rank runs the same checks in the same order and writes ``rank<N>.json``. Both jobs start
Horovod as Horovod's docs do (plain ``hvd.init()``) before any Trainer exists; the strategy keeps
that start (DASO reaches its partners through global alltoalls, no process sets). The suite runs
``two_by_two`` at the end of the two-node job (hierarchical_checks.py) and this script for ``two_by_one``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import horovod.torch as hvd
from _common import Checks, out_dir, parse_out, write_result
from daso_resume import resume_matches_uninterrupted
from daso_training import (
    check_closing_average,
    check_merge_weight,
    fit,
    refuses_iterable_without_length,
)
from finetuning import UnfreezeExtra
from lightning.pytorch import Callback, LightningModule, Trainer
from models import MlpClassifier, TwoOptimizerClassifier

CYCLING = {"warmup_epochs": 1, "cooldown_epochs": 1, "stable_epochs": 2, "cycling": "always"}
SGD_BYTES = {"optimizer": "sgd", "batchnorm": False, "epochs": 2}

two_by_two = Checks()
"""DASO's checks on two nodes of two workers."""
two_by_one = Checks()
"""DASO's checks on two nodes of one worker."""


@two_by_one.register
def resume_mid_cycling() -> dict[str, Any]:
    return resume_matches_uninterrupted(out_dir())


for both in (two_by_two, two_by_one):
    both.register(check_merge_weight)
    both.register(check_closing_average)


@two_by_two.register
def daso_adam_fp16() -> dict[str, Any]:
    return fit("daso", epochs=5, daso=CYCLING)


@two_by_two.register
def daso_adam_per_node_state() -> dict[str, Any]:
    return fit("daso", epochs=5, daso=CYCLING | {"average_optimizer_state": False})


@two_by_two.register
def allreduce_adam() -> dict[str, Any]:
    return fit("allreduce", epochs=5)


@two_by_two.register
def daso_sgd_fp16() -> dict[str, Any]:
    return fit("daso", daso={"cooldown_epochs": 0, "warmup_epochs": 1, "cycling": "always"}, **SGD_BYTES)


@two_by_two.register
def daso_sgd_fp32() -> dict[str, Any]:
    return fit(
        "daso", daso={"cooldown_epochs": 0, "warmup_epochs": 1, "downcast": "fp32", "cycling": "always"}, **SGD_BYTES
    )


@two_by_two.register
def allreduce_sgd() -> dict[str, Any]:
    return fit("allreduce", **SGD_BYTES)


@two_by_one.register
def daso_with_a_layer_one_node_never_uses() -> dict[str, Any]:
    """Node 1 must still get Adam state for node 0's layer (zero-filled gradients); two micro-batches a step."""
    model = MlpClassifier("adam", True, node_zero_branch=True)
    return fit("daso", epochs=3, daso=CYCLING, batches=12, accumulate=2, model=model)


@two_by_one.register
def daso_two_optimizers() -> dict[str, Any]:
    return fit("daso", epochs=3, daso=CYCLING, model=TwoOptimizerClassifier())


@two_by_one.register
def daso_unfreeze() -> dict[str, Any]:
    return fit(
        "daso",
        epochs=4,
        daso={"warmup_epochs": 1, "cooldown_epochs": 1, "cycling": "always"},
        model=MlpClassifier("adam", True, frozen_extra=True),
        callbacks=[UnfreezeExtra(new_group=True, epoch=2)],
    )


two_by_one.register(refuses_iterable_without_length)  # last: the fit stops with an error

TOPOLOGIES = {"two_by_two": two_by_two, "two_by_one": two_by_one}


def main() -> None:
    out, args = parse_out()
    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="two_by_one")
    topology, _ = parser.parse_known_args()
    hvd.init()  # plain, as users start; the strategy keeps it
    write_result(out, hvd.rank(), TOPOLOGIES[topology.topology].selected(args.case).run())


class SlowPhase(Callback):
    """Sleeps 120 ms before every batch of the phases named: a link on which those steps cost more.

    The probe compares mean steps, so one stall of the loaded machine in the other phase's epoch can
    outweigh a small penalty; 120 ms a step takes a stall of a second and more to turn the verdict."""

    def __init__(self, *phases: str) -> None:
        self.phases = phases

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, index: int) -> None:
        schedule = trainer.strategy.daso_sync.schedule
        if schedule.phase.value in self.phases:
            time.sleep(0.12)


AUTO = {"warmup_epochs": 1, "cooldown_epochs": 1, "stable_epochs": 2, "cycling": "auto"}


@two_by_one.register
def daso_stops_cycling_where_it_is_slower() -> dict[str, Any]:
    """cycling="auto" with cycling steps 120 ms slower: the third epoch averages over all workers instead."""
    return fit("daso", epochs=4, daso=AUTO, callbacks=[SlowPhase("cycling")])


@two_by_one.register
def daso_keeps_cycling_where_it_pays() -> dict[str, Any]:
    """cycling="auto" with synchronous steps 120 ms slower: cycling goes on."""
    return fit("daso", epochs=4, daso=AUTO, callbacks=[SlowPhase("warmup", "cooldown")])


if __name__ == "__main__":
    main()
