"""What does ``sparse_as_dense`` cost or save? Sparse embedding gradients as allgathers or as one allreduce.

Two workers on this machine, one thread each, started by ``horovodrun -np 2 --gloo``. Each job trains
an ``nn.Embedding(ROWS, WIDTH, sparse=True)`` with SGD through Horovod's ``DistributedOptimizer``,
as ``HorovodStrategy`` does, once with the default (a sparse gradient travels as two allgathers: the
looked-up rows' indices and values of every worker) and once with ``sparse_as_dense=True`` (the
gradient becomes a dense table and takes one allreduce). Two cases: a batch that looks up few rows
of the table, and one that looks up many. A timed step is forward, backward and ``step`` (which
waits for the collectives); ``--iterations`` timed steps after ``WARMUP`` untimed ones; the table
gives rank 0's median and the 10th-90th percentile, and the bytes each worker sends per step.

    python benchmarks/sparse_gradients.py           # writes docs/benchmarks/sparse_gradients.txt
    python benchmarks/sparse_gradients.py --smoke   # a small table, few steps; writes no report
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

FULL = {"rows": 200_000, "width": 64, "lookups": {"few rows": 256, "many rows": 65_536}}
SMOKE = {"rows": 2_000, "width": 8, "lookups": {"few rows": 16, "many rows": 1_024}}
WARMUP = 3
MODES = {"sparse (default)": False, "sparse_as_dense=True": True}


def worker_main(sparse_as_dense: bool, sizes: dict[str, Any], rounds: int, out: Path) -> None:
    """Time training steps of each case; the rank and size are horovodrun's."""
    import horovod.torch as hvd

    bench.one_thread_per_worker()
    hvd.init()
    results: dict[str, Any] = {}
    for index, (case, lookups) in enumerate(sizes["lookups"].items()):
        torch.manual_seed(0)
        table = nn.Embedding(sizes["rows"], sizes["width"], sparse=True)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(table.parameters(), lr=0.01),
            named_parameters=[(f"case{index}.{name}", p) for name, p in table.named_parameters()],
            sparse_as_dense=sparse_as_dense,
        )
        generator = torch.Generator().manual_seed(1 + hvd.rank())
        seconds = []
        for step in range(WARMUP + rounds):
            rows = torch.randint(0, sizes["rows"], (lookups,), generator=generator)
            started = time.perf_counter()
            optimizer.zero_grad()
            table(rows).sum().backward()
            optimizer.step()
            if step >= WARMUP:
                seconds.append(time.perf_counter() - started)
        results[case] = seconds
        hvd.barrier()
    write_rank_file(out, hvd.rank(), results)


def sent_bytes(sizes: dict[str, Any], lookups: int, dense: bool) -> int:
    """What one worker sends per step: the whole float32 table, or its looked-up rows (values, int64 indices)."""
    width = int(sizes["width"])
    return int(sizes["rows"]) * width * 4 if dense else lookups * (width * 4 + 8)


def measure(sizes: dict[str, Any], rounds: int, workdir: Path) -> dict[str, dict[str, Any]]:
    """Rank 0's step times, per mode."""
    outcomes = {}
    for index, (mode, dense) in enumerate(MODES.items()):
        out = workdir / f"job{index}"
        script = [
            str(Path(__file__).resolve()),
            "--worker",
            "dense" if dense else "sparse",
            "--iterations",
            str(rounds),
        ]
        script += ["--smoke"] if sizes is SMOKE else []
        outcome = bench.horovodrun(script, out, np=2, timeout=900).check(f"sparse_gradients job {mode!r}")
        if 0 not in outcome.results:
            raise RuntimeError(f"rank 0 of job {mode!r} wrote no result:\n{outcome.output[-3000:]}")
        outcomes[mode] = outcome.results[0]
    return outcomes


def report(sizes: dict[str, Any], rounds: int, outcomes: dict[str, dict[str, Any]]) -> str:
    rows = []
    for case, lookups in sizes["lookups"].items():
        sparse_ms = 1e3 * statistics.median(outcomes["sparse (default)"][case])
        for mode, dense in MODES.items():
            seconds = outcomes[mode][case]
            deciles = statistics.quantiles(seconds, n=10, method="inclusive") if len(seconds) > 1 else [seconds[0]] * 9
            median_ms = 1e3 * statistics.median(seconds)
            rows.append([
                f"{case} ({lookups:,})", mode, f"{sent_bytes(sizes, lookups, dense) / 2**20:.2f}",
                f"{median_ms:.1f}", f"{1e3 * deciles[0]:.1f}-{1e3 * deciles[-1]:.1f}", f"{median_ms / sparse_ms:.2f}",
            ])  # fmt: skip
    header = (
        f"sparse_gradients: 2 workers on CPU, 1 thread each; nn.Embedding({sizes['rows']:,}, {sizes['width']}, "
        f"sparse=True) with SGD through Horovod's DistributedOptimizer; a step is forward, backward and step; "
        f"{rounds} timed steps after {WARMUP} untimed, rank 0; ms = median, p10-p90 beside it; MiB = what one "
        "worker sends per step."
    )
    table = format_table(["lookups per worker-step", "gradient", "MiB sent", "ms", "p10-p90", "/ sparse"], rows)
    return f"{header}\n\n{table}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a small table, few steps; writes no report")
    parser.add_argument("--iterations", type=int, help="timed steps per case (default 20; 3 with --smoke)")
    parser.add_argument(
        "--report", type=Path, help="write the table here (default: docs/benchmarks/sparse_gradients.txt)"
    )
    parser.add_argument("--worker", choices=("sparse", "dense"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rounds = args.iterations if args.iterations is not None else (3 if args.smoke else 20)
    if rounds < 1:
        parser.error(f"--iterations {rounds} must be >= 1")
    sizes = SMOKE if args.smoke else FULL
    if args.worker:
        worker_main(args.worker == "dense", sizes, rounds, args.out)
        return 0
    with tempfile.TemporaryDirectory(prefix="hvd_sparse_gradients_") as tmp:
        text = report(sizes, rounds, measure(sizes, rounds, Path(tmp)))
    publish_report(text, __file__, argv, args.report, None if args.smoke else "sparse_gradients.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
