"""Node-aware sync modes launched with unequal workers per node must fail the same way on every rank.

Run under ``horovodrun -np 3 -H localhost:2,127.0.0.1:1``. Each mode named by ``--syncs`` is tried
in turn in the same job (the error comes at setup, before any process set exists); each rank
writes ``{sync: error}``.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
from _common import parse_out, write_result
from faults_common import trainer
from models import FaultNet, fault_loader

from hvd_plugins.pytorch import HorovodStrategy

OUT, _ = parse_out()
parser = argparse.ArgumentParser()
parser.add_argument("--syncs", default="hierarchical,daso")
ARGS, _ = parser.parse_known_args()

errors = {}
for sync in ARGS.syncs.split(","):
    try:
        trainer(HorovodStrategy(sync=sync)).fit(FaultNet(), fault_loader(n=64))
        errors[sync] = "no error"
    except ValueError as raised:
        errors[sync] = f"ValueError: {raised}"
write_result(OUT, hvd.rank(), errors)
