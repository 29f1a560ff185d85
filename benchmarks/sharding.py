"""What sharding saves and costs: per-worker memory, step time and bytes, unsharded against ZeRO-1, ZeRO-2, ZeRO-3.

The Transformer language model of the benchmarks (AdamW) trains on synthetic tokens under horovodrun,
once per setting and number of workers; each worker reports what it holds after the last step
(``PeakMemoryMonitor``: parameters, gradients, optimizer state, peak resident memory), its median
step time after warmup, and the bytes its counters recorded.

    python benchmarks/sharding.py            # N = 1, 2, 4 and 2x1, 2x2; writes docs/benchmarks/sharding.txt
    python benchmarks/sharding.py --smoke    # tiny, N = 2 and 2x1 only: checks that everything runs
    python benchmarks/sharding.py --does-not-fit   # 4 workers, a 151 M-parameter MLP under a memory limit each
    python benchmarks/sharding.py --hybrid   # 2x2, sync="hierarchical" unsharded against sharded inside the node

Memory: N = 1, 2 (one host) and 4 (two emulated hosts of two). Step time: two emulated hosts of one
worker (2x1) and of two (2x2), unshaped loopback, medians of ``--repeats`` jobs, the settings in
turn. The aims: optimizer state per worker within 5 % of 1/N of unsharded (and for
ZeRO-2 the gradients after the step), step time at least 1.0x of unsharded, equal cross-node bytes
for ZeRO-2. ``--hybrid``: sharded inside the node (``sync="hierarchical"``) on 2x2, against the
unsharded two-level allreduce: state per worker 1/L, step time at least 0.95x, cross-node bytes no more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

SHARDS = ("none", "optimizer", "gradients", "parameters")
HYBRID_SHARDS = ("none", "optimizer", "gradients")
"""Sharding inside the node (``sync="hierarchical"``): full sharding is refused there."""
MODEL = {"vocab": 2048, "d_model": 112, "layers": 16, "heads": 4, "context": 64}
SMOKE_MODEL = {"vocab": 64, "d_model": 16, "layers": 1, "heads": 2, "context": 8}
TOPOLOGIES = {1: "localhost:1", 2: "localhost:2", 4: "localhost:2,127.0.0.1:2"}
STEP_TOPOLOGIES = {"2x1": (2, "localhost:1,127.0.0.1:1"), "2x2": (4, "localhost:2,127.0.0.1:2")}
STATE_AIM = 0.05
"""Optimizer state per worker within 5 % of 1/N of the unsharded state."""


def worker_main(args: argparse.Namespace) -> None:
    """Train with ``--shard`` and write what this worker held, its step times and its counters."""
    import horovod.torch as hvd
    from torch.utils.data import DataLoader

    from hvd_plugins import HorovodStrategy
    from hvd_plugins.pytorch.callbacks import PeakMemoryMonitor

    bench.one_thread_per_worker()
    size = json.loads(args.size)
    hvd.init()  # the strategy keeps a script's own start; every worker trains ``steps`` batches
    strategy = HorovodStrategy(shard=args.shard, sync=args.sync)
    module = bench.build_module("transformer", **size)
    data = bench.synthetic_data("transformer", args.batch_size * args.steps * hvd.size(), **size)
    module.train_dataloader = lambda: DataLoader(data, batch_size=args.batch_size)  # type: ignore[method-assign]
    clock, memory = bench.StepClock(), PeakMemoryMonitor(print_table=False)
    trainer = bench.cpu_trainer(strategy, [clock, memory])
    trainer.fit(module)
    held = {measure: values[hvd.rank()] for measure, values in memory.history[-1].per_worker.items()}
    steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)][args.warmup_steps :]
    counters = trainer.strategy.comm_counters.as_dict()
    write_rank_file(
        args.out,
        hvd.rank(),
        {"held": held, "step_seconds": statistics.median(steps), "counters": counters, "steps": len(clock.times)},
    )


BIG_LAYERS, BIG_WIDTH = 9, 4096
"""The model that does not fit: nine 4096x4096 linear layers, 151 M parameters, 0.6 GB in float32; with
AdamW 2.4 GB of parameters, gradients and state unsharded, 1.05 GB with ZeRO-2 on 4 workers (after the step)."""


def limit_address_space(extra_gb: float) -> int:
    """Cap this process's address space (``RLIMIT_AS``) at what it maps now plus ``extra_gb``: the worker, not the
    machine, runs out. Returns the cap in bytes."""
    import resource

    mapped = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    cap = mapped + int(extra_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


def fit_worker(args: argparse.Namespace) -> None:
    """A few AdamW steps of the big MLP under a memory cap; writes whether they ran, or the allocation error."""
    import os

    import horovod.torch as hvd
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from hvd_plugins import HorovodStrategy

    class BigRegressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*(nn.Sequential(nn.Linear(BIG_WIDTH, BIG_WIDTH), nn.Tanh()) for _ in range(9)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def train_dataloader(self) -> DataLoader:
            samples = 4 * args.steps * hvd.size()
            return DataLoader(TensorDataset(torch.randn(samples, BIG_WIDTH), torch.randn(samples, BIG_WIDTH)), 4)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    bench.one_thread_per_worker()
    hvd.init()
    strategy = HorovodStrategy(shard=args.shard, bucket_mb=64.0, stall_timeout_seconds=120)
    outcome: dict[str, Any] = {"cap_gb": limit_address_space(args.limit_gb) / 2**30}
    try:
        clock = bench.StepClock()
        bench.cpu_trainer(strategy, [clock]).fit(BigRegressor())
        outcome.update(steps=len(clock.times), seconds=clock.total)
    except (MemoryError, RuntimeError) as error:  # torch raises RuntimeError("... can't allocate memory")
        outcome.update(steps=0, error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
    write_rank_file(args.out, hvd.rank(), outcome)
    os._exit(0 if outcome["steps"] else 1)  # a worker that ran out ends the job: the others wait in a collective


def does_not_fit(limit_gb: float, steps: int, workdir: Path) -> str:
    """The big MLP on 4 workers (two emulated hosts of two), each capped at ``limit_gb`` beyond what it maps at
    start: unsharded, ZeRO-1, ZeRO-2 and ZeRO-3 (every layer a unit)."""
    rows = []
    for shard in SHARDS:
        script = [
            str(Path(__file__).resolve()),
            "--fit-worker",
            f"--shard={shard}",
            f"--steps={steps}",
            f"--limit-gb={limit_gb}",
        ]
        outcome = bench.horovodrun(script, workdir / f"fit_{shard}", np=4, hosts=TOPOLOGIES[4], timeout=1200)
        results = [outcome.results[rank] for rank in sorted(outcome.results)]
        trained = min((r["steps"] for r in results), default=0) if len(results) == 4 else 0
        error = next((r["error"] for r in results if r.get("error")), "" if trained else "a worker ended the job")
        seconds = max((r.get("seconds", 0.0) for r in results), default=0.0)
        rows.append((shard, f"{limit_gb:g}", trained, f"{seconds:.0f}" if trained else "-", error or "trained"))
        print(f"  does not fit: {shard:<9} {trained} steps  {error or 'trained'}", flush=True)
    header = ("shard", "cap GB / worker", "steps trained", "seconds", "outcome")
    return format_table(header, rows)


def run(
    shard: str,
    np: int,
    hosts: str,
    size: dict[str, Any],
    steps: int,
    out: Path,
    batch_size: int,
    sync: str = "allreduce",
) -> dict:
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        f"--shard={shard}",
        f"--sync={sync}",
        f"--size={json.dumps(size)}",
        f"--steps={steps}",
        f"--batch-size={batch_size}",
        f"--warmup-steps={min(3, steps // 3)}",
    ]
    outcome = bench.horovodrun(script, out, np=np, hosts=hosts, timeout=900)
    outcome.check(f"shard={shard} on {np} worker(s)")
    return outcome.results


def memory_table(size: dict[str, Any], steps: int, batch_size: int, workdir: Path, topologies: dict[int, str]) -> str:
    rows = []
    unsharded: dict[int, float] = {}
    for np, hosts in topologies.items():
        for shard in SHARDS:
            results = run(shard, np, hosts, size, steps, workdir / f"mem_{shard}_{np}", batch_size)
            held = [results[rank]["held"] for rank in sorted(results)]
            state = max(h["optimizer_state_mb"] for h in held)
            gradients = max(h["gradients_mb"] for h in held)
            if shard == "none":
                unsharded[np] = state
            share = state / (unsharded[np] / np) if unsharded.get(np) else float("nan")
            verdict = "" if shard == "none" else ("met" if share <= 1 + STATE_AIM else f"missed by {share - 1:.1%}")
            share_cell: float | str = "-" if shard == "none" else share
            rss = max(h.get("cpu_peak_rss_mb", 0.0) for h in held)
            row = (shard, np, held[0]["parameters_mb"], gradients, state, share_cell, rss, verdict)
            rows.append(row)
            print(f"  memory {shard:<9} N={np}  state {state:10.4f} MiB  grads {gradients:10.4f} MiB", flush=True)
    header = ("shard", "N", "params MiB", "grads MiB", "opt state MiB", "state / (unsharded/N)", "peak RSS MiB", "aim")
    return format_table(header, rows)


def step_table(
    size: dict[str, Any], steps: int, batch_size: int, repeats: int, workdir: Path, topologies: dict[str, Any]
) -> str:
    rows = []
    for topology, (np, hosts) in topologies.items():
        seconds: dict[str, list[float]] = {shard: [] for shard in SHARDS}
        cross: dict[str, float] = {}
        for repeat in range(repeats):
            order = SHARDS[repeat % len(SHARDS) :] + SHARDS[: repeat % len(SHARDS)]
            for shard in order:
                results = run(shard, np, hosts, size, steps, workdir / f"step_{topology}_{shard}_{repeat}", batch_size)
                seconds[shard].append(statistics.median(r["step_seconds"] for r in results.values()))
                steps_run = results[0]["steps"]
                cross[shard] = results[0]["counters"]["cross_node_bytes"] / steps_run
        base = statistics.median(seconds["none"])
        for shard in SHARDS:
            median = statistics.median(seconds[shard])
            speed = base / median
            verdict = "" if shard == "none" else ("met" if speed >= 1.0 else f"missed by {1.0 - speed:.2f}x")
            rows.append((topology, shard, 1e3 * median, speed, cross[shard] / 2**20, verdict))
            print(f"  steps {topology} {shard:<9} {1e3 * median:8.1f} ms  {speed:.2f}x", flush=True)
    header = ("hosts", "shard", "step ms (median)", "speed vs none", "cross-node MiB/step (rank 0)", "aim >= 1.0x")
    return format_table(header, rows)


HYBRID_STEP_AIM = 0.95
"""Sharded inside the node: step time at least 0.95x of the unsharded two-level allreduce's."""


def hybrid_table(size: dict[str, Any], steps: int, batch_size: int, repeats: int, workdir: Path) -> str:
    """2x2: ``sync="hierarchical"`` unsharded, ZeRO-1 and ZeRO-2 inside the node; state, step time and cross bytes."""
    np, hosts = STEP_TOPOLOGIES["2x2"]
    seconds: dict[str, list[float]] = {shard: [] for shard in HYBRID_SHARDS}
    state: dict[str, float] = {}
    cross: dict[str, float] = {}
    for repeat in range(repeats):
        for shard in HYBRID_SHARDS[repeat % 3 :] + HYBRID_SHARDS[: repeat % 3]:
            out = workdir / f"hybrid_{shard}_{repeat}"
            results = run(shard, np, hosts, size, steps, out, batch_size, sync="hierarchical")
            seconds[shard].append(statistics.median(r["step_seconds"] for r in results.values()))
            state[shard] = max(r["held"]["optimizer_state_mb"] for r in results.values())
            cross[shard] = max(r["counters"]["cross_node_bytes"] / r["steps"] for r in results.values())
    rows = []
    base = statistics.median(seconds["none"])
    for shard in HYBRID_SHARDS:
        median = statistics.median(seconds[shard])
        speed, share = base / median, state[shard] / state["none"]
        checks = {
            f"state {share:.3f} > 1/2": share > 0.5 * (1 + STATE_AIM),
            f"speed {speed:.2f}x < {HYBRID_STEP_AIM}x": speed < HYBRID_STEP_AIM,
            "more cross-node bytes": cross[shard] > cross["none"],
        }
        misses = [what for what, missed in checks.items() if missed]
        verdict = "" if shard == "none" else ("met" if not misses else "missed: " + "; ".join(misses))
        rows.append((shard, state[shard], share, 1e3 * median, speed, cross[shard] / 2**20, verdict))
        print(f"  hybrid {shard:<9} {1e3 * median:8.1f} ms  {speed:.2f}x  state {state[shard]:.2f} MiB", flush=True)
    header = ("shard", "opt state MiB", "state / unsharded", "step ms (median)", "speed", "cross MiB/step", "aims")
    return format_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps: checks that everything runs")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per setting for the step times")
    parser.add_argument("--report", type=Path, help="write the report here instead of docs/benchmarks/sharding.txt")
    parser.add_argument("--does-not-fit", action="store_true", help="only the big model under a memory cap per worker")
    parser.add_argument("--limit-gb", type=float, default=2.0, help="the cap beyond what a worker maps at start (GB)")
    parser.add_argument("--hybrid", action="store_true", help="only sharding inside the node against unsharded, 2x2")
    parser.add_argument("--sync", default="allreduce", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fit-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup-steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    if args.fit_worker:
        fit_worker(args)
        return 0
    if args.does_not_fit:
        with tempfile.TemporaryDirectory(prefix="sharding_fit_") as workdir:
            table = does_not_fit(args.limit_gb, 3, Path(workdir))
        text = (
            f"A model that does not fit: an MLP of {BIG_LAYERS} {BIG_WIDTH}x{BIG_WIDTH} layers (151 M parameters), "
            f"AdamW, 4 workers on two emulated hosts, each capped (RLIMIT_AS) at {args.limit_gb:g} GB beyond what it "
            f"maps at start\n{table}\n"
        )
        given = sys.argv[1:] if argv is None else argv
        publish_report(text, __file__, given, args.report, "sharding_does_not_fit.txt")
        return 0
    size, steps, batch, repeats = (SMOKE_MODEL, 4, 4, 1) if args.smoke else (MODEL, 20, 16, args.repeats)
    if args.hybrid:
        with tempfile.TemporaryDirectory(prefix="sharding_hybrid_") as workdir:
            table = hybrid_table(size, steps, batch, repeats, Path(workdir))
        text = (
            f"Sharded inside the node: {bench.describe('transformer', **size)}, AdamW, batch {batch}, {steps} steps a "
            f"job, 2x2 (two emulated hosts of two workers), unshaped loopback, sync='hierarchical' unsharded against "
            f"ZeRO-1 and ZeRO-2 split over each node's 2 workers; step time: median over workers and {repeats} "
            f"job(s) a setting; state and cross-node bytes: the most of any worker\n{table}\n"
        )
        given = sys.argv[1:] if argv is None else argv
        publish_report(text, __file__, given, args.report, None if args.smoke else "sharding_hybrid.txt")
        return 0
    memory_topologies = {2: TOPOLOGIES[2]} if args.smoke else TOPOLOGIES
    step_topologies = {"2x1": STEP_TOPOLOGIES["2x1"]} if args.smoke else STEP_TOPOLOGIES
    with tempfile.TemporaryDirectory(prefix="sharding_") as workdir:
        memory = memory_table(size, steps, batch, Path(workdir), memory_topologies)
        timing = step_table(size, steps, batch, repeats, Path(workdir), step_topologies)
    model = bench.describe("transformer", **size)
    text = (
        f"Sharding: {model}, AdamW, batch {batch}, {steps} steps a job, CPU, one thread a worker\n\n"
        f"What each worker holds after the last step (the most of any worker)\n{memory}\n\n"
        f"Step time, unshaped loopback, median over workers and {repeats} job(s) a setting\n{timing}\n"
    )
    publish_report(
        text, __file__, sys.argv[1:] if argv is None else argv, args.report, None if args.smoke else "sharding.txt"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
