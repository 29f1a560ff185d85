"""A node-aware sync mode launched with unequal workers per node must fail the same way on every rank.

Run under ``horovodrun -np 3 -H localhost:2,127.0.0.1:1``.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
from _common import parse_out, write_result
from faults_common import Net, loader, trainer

from hvd_plugins import HorovodStrategy

OUT, _ = parse_out()
parser = argparse.ArgumentParser()
parser.add_argument("--sync", choices=["hierarchical", "daso"], required=True)
ARGS, _ = parser.parse_known_args()

strategy = HorovodStrategy(sync=ARGS.sync)
try:
    trainer(strategy).fit(Net(), loader(n=64))
    error = "no error"
except ValueError as raised:
    error = f"ValueError: {raised}"
write_result(OUT, hvd.rank(), {"error": error})
