"""How many bytes does each sync mode hand to each link per epoch, and do the counters equal the analytic count?

Bytes per epoch on each link are read from ``strategy.comm_counters`` and set next to the formulas below.

Four workers on two emulated nodes (``horovodrun -np 4 -H localhost:2,127.0.0.1:2``), one launch
that fits the same MLP once per (sync, compression) pair. Counts are per worker and per epoch and
are the payload handed to Horovod (after compression), not the ring algorithm's traffic.

    python benchmarks/comm_volume.py            # writes docs/benchmarks/comm_volume.txt
    python benchmarks/comm_volume.py --smoke    # tiny model, few steps

Expected bytes per worker per epoch, with P parameters, L workers per node, S optimizer steps,
b bytes per element on the compressed wire (4 for none, 2 for fp16):

    allreduce      cross-node  P*b*S                      (a flat allreduce over two nodes counts as cross-node)
    hierarchical   node-local  (P + P/L)*4*S              (reduce-scatter input + allgather input, uncompressed)
                   cross-node  (P/L)*b*S                  (each local rank carries one shard)
    daso           node-local  P*b*S + (P/L)*b*(M + 1)    (gradients every step + allgather of the
                                                          cross-node sums: M merges per epoch and the
                                                          closing blocking sync)
                   cross-node  (P/L)*b*(G + 1)            (G parameter-shard sends + the closing blocking
                                                          sync, which carries one shard per local worker
                                                          too: a node's workers hold the same parameters)

DASO runs in its cycling phase (no warmup epochs): a send every ``global_skips`` = 4 steps before the
last one, so G = floor((S - 1) / 4), received (merged) one step later unless that is the last step,
which syncs blocking. SGD without momentum and no buffers: no optimizer state crosses. For DASO the
compression column sets both the node-local gradients' compression and the cross-node parameters'
``downcast`` (none = fp32).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

SYNCS = ("allreduce", "hierarchical", "daso")
FIT_ORDER = ("daso", "hierarchical", "allreduce")
COMPRESSIONS = ("none", "fp16")
WIRE_BYTES = {"none": 4, "fp16": 2}
DASO_CYCLING_GLOBAL_SKIPS = 4


@dataclass(frozen=True)
class Setup:
    features: int
    hidden: tuple[int, ...]
    classes: int
    batch_size: int
    steps: int


FULL = Setup(features=512, hidden=(1024, 1024), classes=10, batch_size=16, steps=12)
SMOKE = Setup(features=32, hidden=(64,), classes=4, batch_size=8, steps=6)
"""Six steps: DASO sends once and merges once before the closing sync, as in the full run."""


def expected_bytes(sync: str, compression: str, params: int, local_size: int, steps: int) -> dict[str, int]:
    """Analytic payload per worker per epoch (see the module docstring)."""
    wire = WIRE_BYTES[compression]
    shard = math.ceil(params / local_size)  # buckets are padded to a multiple of L
    if sync == "allreduce":
        return {"node_local": 0, "cross_node": params * wire * steps}
    if sync == "hierarchical":
        return {"node_local": (params + shard) * 4 * steps, "cross_node": shard * wire * steps}
    sends = (steps - 1) // DASO_CYCLING_GLOBAL_SKIPS  # the last step syncs blocking instead
    merges = sum(1 for k in range(1, sends + 1) if k * DASO_CYCLING_GLOBAL_SKIPS + 1 < steps)
    return {
        "node_local": params * wire * steps + shard * wire * (merges + 1),
        "cross_node": shard * wire * (sends + 1),
    }


# ------------------------------------------------------------------------------------------ worker
def _fit_once(setup: Setup, sync: str, compression: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from hvd_plugins import HorovodStrategy

    class EpochBytes(pl.Callback):
        """Counter difference over one training epoch."""

        def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.start = trainer.strategy.comm_counters.snapshot()
            self.steps_at_start = trainer.global_step

        def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.window = trainer.strategy.comm_counters.since(self.start)
            self.steps = trainer.global_step - self.steps_at_start

    daso = bench.daso_settings(compression, warmup_epochs=0, cooldown_epochs=0) if sync == "daso" else None
    # Every bucket takes the two-level path (flat_below_mb=0), whose legs the analytic table counts.
    two_level = {"flat_below_mb": 0.0} if sync == "hierarchical" else {}
    strategy = HorovodStrategy(sync=sync, compression=compression, daso=daso, **two_level)
    strategy.set_world_ranks()
    meter = EpochBytes()
    trainer = bench.cpu_trainer(strategy, [meter])
    samples = setup.batch_size * setup.steps * strategy.world_size
    dataset = bench.random_classification(samples, setup.features, setup.classes)
    module = bench.Classifier(setup.features, setup.hidden, setup.classes, lr=0.01)
    trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=setup.batch_size, shuffle=True))
    return {
        "node_local": meter.window.node_local_bytes,
        "cross_node": meter.window.cross_node_bytes,
        "steps": meter.steps,
        "params": bench.parameter_count(module),
    }


def worker_main(args: argparse.Namespace) -> None:
    import horovod.torch as hvd

    bench.one_thread_per_worker()
    setup = FULL if args.size == "full" else SMOKE
    hvd.init()
    results: dict[str, Any] = {"local_size": hvd.local_size(), "cross_size": hvd.cross_size(), "runs": {}}
    for sync in args.syncs.split(","):
        for compression in COMPRESSIONS:
            results["runs"][f"{sync}/{compression}"] = _fit_once(setup, sync, compression)
            if hvd.rank() == 0:
                print(f"comm_volume: fitted sync={sync} compression={compression}", flush=True)
    write_rank_file(args.out, hvd.rank(), results)


# ------------------------------------------------------------------------------------------ driver
def measure(size: str, syncs: list[str], workdir: Path, timeout: float) -> dict[int, dict[str, Any]]:
    script = [str(Path(__file__).resolve()), "--worker", f"--size={size}", f"--syncs={','.join(syncs)}"]
    outcome = bench.horovodrun(
        script,
        workdir,
        np=4,
        hosts=bench.TWO_EMULATED_NODES,
        timeout=timeout,
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "120"},
    )
    if sorted(outcome.results) != [0, 1, 2, 3]:
        outcome.check("comm_volume job")
        raise RuntimeError(f"expected results from ranks 0-3, got {sorted(outcome.results)}:\n{outcome.output[-3000:]}")
    if outcome.returncode != 0:  # every rank wrote its counts; only the job's exit went wrong
        print(f"warning: the job exited with code {outcome.returncode} after every rank wrote its counts", flush=True)
    return outcome.results


def report(setup: Setup, ranks: dict[int, dict[str, Any]]) -> tuple[str, bool]:
    first = ranks[0]
    local_size = first["local_size"]
    rows = []
    all_match = True
    for sync in SYNCS:
        for compression in COMPRESSIONS:
            key = f"{sync}/{compression}"
            run = first["runs"][key]
            expected = expected_bytes(sync, compression, run["params"], local_size, run["steps"])
            match = all(
                ranks[r]["runs"][key][scope] == expected[scope] for r in ranks for scope in ("node_local", "cross_node")
            )
            all_match &= match
            rows.append(
                [
                    sync,
                    compression,
                    run["node_local"],
                    expected["node_local"],
                    run["cross_node"],
                    expected["cross_node"],
                    "yes (all ranks)" if match else "NO",
                ]
            )
    any_run = next(iter(first["runs"].values()))
    header = (
        f"comm_volume: 4 workers on 2 emulated nodes (local_size {local_size}, cross_size {first['cross_size']}); "
        f"MLP {setup.features}-{'-'.join(map(str, setup.hidden))}-{setup.classes}, P = {any_run['params']:,} "
        f"parameters; {any_run['steps']} optimizer steps per epoch; bytes per worker per epoch"
    )
    table = format_table(
        ["sync", "compression", "node-local", "expected", "cross-node", "expected", "exact match"], rows
    )
    return f"{header}\n\n{table}", all_match


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few steps; writes no report")
    parser.add_argument(
        "--report", type=Path, help="write the table here (default: docs/benchmarks/comm_volume.txt; none with --smoke)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=("full", "smoke"), default="full", help=argparse.SUPPRESS)
    parser.add_argument("--syncs", default=",".join(SYNCS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    setup = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory(prefix="hvd_comm_volume_") as tmp:
        size, timeout = ("smoke", 300) if args.smoke else ("full", 600)
        ranks = measure(size, list(FIT_ORDER), Path(tmp), timeout=timeout)
    text, all_match = report(setup, ranks)
    text += "\n\nall measured counts equal the analytic expectation" if all_match else "\n\nSOME COUNTS DIFFER (see NO)"
    publish_report(text, __file__, argv, args.report, None if args.smoke else "comm_volume.txt")
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
