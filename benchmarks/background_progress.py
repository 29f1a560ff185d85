"""Does a collective Horovod runs in the background move while the workers compute?

DASO's cross-node legs are non-blocking: the first leg of a merge is started after one optimizer
step and awaited one step later, so it is free only if Horovod's background thread moves it while
the worker runs its next forward and backward. This measures that on this machine.

Four workers (the emulated cluster's two nodes of two: two workers per core here), then two (one
per core), one intra-op thread each, started by ``horovodrun --gloo``. Each sends DASO's merge leg
for the large benchmark model, its shard of the float16 drift (the MLP 256-1024-512-10's 793,098
parameters split over the node's workers), to the worker with its local rank on the other node,
as a partner-only ``alltoall``. Per round, every case starts it after all workers line up, and
takes the time at which it is done:

- ``awaited at once``: ``hvd.synchronize`` right after starting it (the leg by itself);
- ``polled, idle``: polled every 0.2 ms, the worker asleep in between (the CPU left to Horovod);
- ``polled, computing``: polled after each forward and backward of the model on a 32-sample
  batch (the benchmark's per-worker batch), as DASO's next step would run.

The table gives rank 0's median and the 10th-90th percentile, the share of rounds in which the
leg was done by the end of the first forward and backward, and that pass's time with and
without the leg in flight. Every received shard is checked.

    python benchmarks/background_progress.py           # writes docs/benchmarks/background_progress.txt
    python benchmarks/background_progress.py --smoke   # two workers, a small model; writes no report
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

FULL_WIDTHS = (256, 1024, 512, 10)
"""The emulated cluster's large model (benchmarks/emulated_cluster.py)."""
SMOKE_WIDTHS = (16, 32, 4)
BATCH = 32
"""The emulated cluster's global batch of 128 over four workers."""
WARMUP = 3
POLL_SECONDS = 0.0002
MAX_POLL_SECONDS = 2.0
"""A leg still in flight after this long of passes is awaited; the round then counts as not done. A time,
not a pass count: the smoke model's passes are so short that a count gave a loaded machine's legs
tens of milliseconds (the full model's 200 passes of 6.5 ms were 1.3 s; its slowest leg took 0.6 s)."""
CASES = ("awaited at once", "polled, idle", "polled, computing")


# ------------------------------------------------------------------------------------------ worker
@dataclass(frozen=True)
class Waited:
    """When a case saw the leg done (``inf``: not within ``MAX_POLL_SECONDS``), what arrived, the passes meanwhile."""

    done: float
    received: torch.Tensor
    passes: int = 0
    first_pass_end: float | None = None


def shard_numel(widths: Sequence[int], local_size: int) -> int:
    """A worker's shard of the model's flat parameters: DASO splits them over the node's workers."""
    model = bench.mlp(widths[0], widths[1:-1], widths[-1])
    return math.ceil(sum(p.numel() for p in model.parameters()) / local_size)


def forward_backward(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(inputs), labels).backward()


def worker_main(widths: Sequence[int], rounds: int, out: Path) -> None:
    """Time each case of ``CASES``; the worker's partner is the one with its local rank on the other node."""
    import horovod.torch as hvd

    bench.one_thread_per_worker()
    hvd.init()
    rank, size, local_size = hvd.rank(), hvd.size(), hvd.local_size()
    partner = (rank + local_size) % size
    numel = shard_numel(widths, local_size)
    splits = torch.zeros(size, dtype=torch.int32)
    splits[partner] = numel
    model = bench.mlp(widths[0], widths[1:-1], widths[-1])
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(BATCH, widths[0], generator=generator)
    labels = torch.randint(0, widths[-1], (BATCH,), generator=generator)

    def await_at_once(handle: Any) -> Waited:
        received = hvd.synchronize(handle)[0]
        return Waited(time.perf_counter(), received)

    def poll_idle(handle: Any) -> Waited:
        while not hvd.poll(handle):
            time.sleep(POLL_SECONDS)
        return Waited(time.perf_counter(), hvd.synchronize(handle)[0])

    def poll_computing(handle: Any) -> Waited:
        pass_ends: list[float] = []
        deadline = time.perf_counter() + MAX_POLL_SECONDS
        while not (in_flight_done := hvd.poll(handle)) and time.perf_counter() < deadline:
            forward_backward(model, inputs, labels)
            pass_ends.append(time.perf_counter())
        done = time.perf_counter() if in_flight_done else math.inf
        return Waited(done, hvd.synchronize(handle)[0], len(pass_ends), pass_ends[0] if pass_ends else None)

    cases: tuple[Callable[[Any], Waited], ...] = (await_at_once, poll_idle, poll_computing)
    waits = dict(zip(CASES, cases, strict=True))
    results: dict[str, Any] = {"numel": numel, "size": size, "local_size": local_size}
    results |= {case: {"ms": [], "passes": [], "first_pass_ms": []} for case in CASES}
    results["pass alone"] = []
    for index in range(WARMUP + rounds):
        started = time.perf_counter()
        forward_backward(model, inputs, labels)
        alone_ms = 1e3 * (time.perf_counter() - started)
        for case, wait in waits.items():
            payload = torch.full((numel,), float(rank + 1), dtype=torch.float16)
            hvd.allreduce(torch.zeros(1), name=f"line_up.{index}.{case}")
            started = time.perf_counter()
            handle = hvd.alltoall_async(payload, splits=splits, name=f"leg.{index}.{case}")
            waited = wait(handle)
            received = waited.received
            if received.numel() != numel or not torch.all(received == float(partner + 1)):
                raise AssertionError(f"rank {rank} received {received[:4].tolist()}..., expected {partner + 1}")
            if index >= WARMUP:
                results[case]["ms"].append(1e3 * (waited.done - started))
                results[case]["passes"].append(waited.passes)
                if waited.first_pass_end is not None:
                    results[case]["first_pass_ms"].append(1e3 * (waited.first_pass_end - started))
        if index >= WARMUP:
            results["pass alone"].append(alone_ms)
    write_rank_file(out, rank, results)


# ------------------------------------------------------------------------------------------ driver
def measure(widths: Sequence[int], rounds: int, workers: int, workdir: Path) -> dict[str, Any]:
    """Rank 0's results: ``workers`` workers on this machine, as two nodes (``localhost`` and ``127.0.0.1``)."""
    per_node = workers // 2
    hosts = f"localhost:{per_node},127.0.0.1:{per_node}"
    script = [str(Path(__file__).resolve()), "--worker", "--widths", ",".join(map(str, widths)),
              "--iterations", str(rounds)]  # fmt: skip
    outcome = bench.horovodrun(script, workdir, np=workers, hosts=hosts, timeout=600).check("background_progress")
    if 0 not in outcome.results:
        raise RuntimeError(f"rank 0 wrote no result:\n{outcome.output[-3000:]}")
    return outcome.results[0]


def _spread_ms(values: Sequence[float]) -> tuple[str, str]:
    """Median and the 10th-90th percentile, in ms ('-' where a round never finished)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return "not done", "-"
    deciles = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return f"{statistics.median(values):.1f}", f"{deciles[0]:.1f}-{deciles[-1]:.1f}"


def report(widths: Sequence[int], rounds: int, results: dict[str, Any]) -> str:
    alone = statistics.median(results["pass alone"])
    rows = []
    for case in CASES:
        entry = results[case]
        median_ms, spread = _spread_ms(entry["ms"])
        if entry["passes"] and max(entry["passes"]) > 0:
            within_one = sum(1 for p in entry["passes"] if p <= 1) / len(entry["passes"])
            first_pass = f"{statistics.median(entry['first_pass_ms']):.1f}"
            computing = [f"{100 * within_one:.0f} %", first_pass]
        else:
            computing = ["-", "-"]
        rows.append([case, median_ms, spread, *computing])
    size, local = results["size"], results["local_size"]
    header = (
        f"background_progress: {size} workers on CPU as {size // local} nodes of {local} (horovodrun --gloo), "
        f"1 thread each; a partner-only alltoall of {results['numel']:,} float16 "
        f"({results['numel'] * 2 / 2**20:.2f} MiB: a worker's shard of MLP {'-'.join(map(str, widths))}'s "
        f"parameters, DASO's merge leg) to the worker with its local rank on the other node; {rounds} timed rounds "
        f"after {WARMUP} untimed, rank 0. 'done ms' = when the worker saw the leg done after starting it (median, "
        f"p10-p90 beside it); 'done within 1st pass' = rounds in which it was done by the end of the first forward "
        f"and backward (batch {BATCH}); '1st pass ms' = that pass with the leg in flight. The same pass alone: "
        f"{alone:.1f} ms (median)."
    )
    table = format_table(["case", "done ms", "p10-p90", "done within 1st pass", "1st pass ms"], rows)
    return f"{header}\n\n{table}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="two workers, a small model, few rounds; no report")
    parser.add_argument("--iterations", type=int, help="timed rounds (default 30; 3 with --smoke)")
    parser.add_argument(
        "--workers", help="comma-separated worker counts, each run as two nodes (default 4,2; 2 with --smoke)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        help="write the table here (default: docs/benchmarks/background_progress.txt; none with --smoke)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--widths", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rounds = args.iterations if args.iterations is not None else (3 if args.smoke else 30)
    if rounds < 1:
        parser.error(f"--iterations {rounds} must be >= 1")
    if args.worker:
        worker_main([int(w) for w in args.widths.split(",")], rounds, args.out)
        return 0
    counts = args.workers if args.workers is not None else ("2" if args.smoke else "4,2")
    try:
        workers = [int(count) for count in counts.split(",")]
    except ValueError:
        parser.error(f"--workers {counts!r} must be comma-separated whole numbers")
    odd = [count for count in workers if count < 2 or count % 2]
    if odd:
        parser.error(f"--workers {odd[0]} must be an even number >= 2 (two nodes of equal size)")
    widths = SMOKE_WIDTHS if args.smoke else FULL_WIDTHS
    tables = []
    with tempfile.TemporaryDirectory(prefix="hvd_background_progress_") as tmp:
        for count in workers:
            tables.append(report(widths, rounds, measure(widths, rounds, count, Path(tmp) / f"np{count}")))
    text = "\n\n".join(tables)
    publish_report(text, __file__, argv, args.report, None if args.smoke else "background_progress.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
