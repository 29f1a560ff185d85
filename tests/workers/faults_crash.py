"""One rank fails in the middle of an epoch; the job must end, non-zero, with nothing left running.

``--case raise``: the victim raises. ``--case kill``: the victim SIGKILLs itself. ``--case stall``:
the victim stays alive but never joins the step's gradient allreduce (it sleeps).
``--stall-timeout T`` is passed to ``HorovodStrategy(stall_timeout_seconds=T)``; without it the
strategy keeps its default ("auto").
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import horovod.torch as hvd
from _common import parse_out
from faults_common import record_pid, trainer
from models import FaultNet, fault_loader

from hvd_plugins.pytorch import HorovodStrategy

OUT, _ = parse_out()
parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["raise", "kill", "stall"], required=True)
parser.add_argument("--victim", type=int, default=1)
parser.add_argument("--stall-timeout", type=float, default=None)
ARGS, _ = parser.parse_known_args()
FAULT_AT_BATCH = 3


def inject(module: FaultNet, batch_idx: int) -> None:
    if hvd.rank() != ARGS.victim or batch_idx != FAULT_AT_BATCH:
        return None
    print(f"injecting {ARGS.case} on rank {hvd.rank()} at batch {batch_idx}", flush=True)
    if ARGS.case == "raise":
        raise RuntimeError(f"injected failure on rank {hvd.rank()}")
    if ARGS.case == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # alive, but missing from every collective from now on
    return None


timeout = {} if ARGS.stall_timeout is None else {"stall_timeout_seconds": ARGS.stall_timeout}
strategy = HorovodStrategy(**timeout)
fit = trainer(strategy, epochs=3)
record_pid(OUT, hvd.rank())
fit.fit(FaultNet(on_step=inject), fault_loader(n=512))
print(f"rank {hvd.rank()} finished training, which it should not have", flush=True)
