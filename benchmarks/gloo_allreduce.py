"""Where does Horovod's Gloo allreduce lose to torch's on the same bytes?

Two workers on this machine, one thread each, started by ``horovodrun -np 2 --gloo``. Three jobs,
one library each, so neither library's threads take CPU from the other's:

- ``Horovod``: ``hvd.allreduce_async_``, every tensor started before any is awaited;
- ``Horovod, no fusion buffer``: the same with ``HOROVOD_FUSION_THRESHOLD=0``, which shows whether
  copying into and out of the buffer is what costs;
- ``torch``: ``torch.distributed.all_reduce(async_op=True)`` on a Gloo process group (what
  Lightning's DDP uses on CPU); this job never starts Horovod.

Each job sums the overhead model's gradients (MLP 1024-2048-2048-10, 24 MiB of float32) as one
tensor, then as the model's tensors (weights and biases), ``--iterations`` timed rounds after
``WARMUP`` untimed ones; the table gives rank 0's median and the 10th-90th percentile. Every sum
is checked against the expected value.

    python benchmarks/gloo_allreduce.py           # writes docs/benchmarks/gloo_allreduce.txt
    python benchmarks/gloo_allreduce.py --smoke   # small tensors, few rounds; writes no report
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

FULL_WIDTHS = (1024, 2048, 2048, 10)
"""The overhead benchmark's MLP (benchmarks/overhead.py): its gradients are the tensors summed here."""
SMOKE_WIDTHS = (16, 32, 4)
WARMUP = 3
JOBS = {
    "Horovod": ("horovod", {}),
    "Horovod, no fusion buffer": ("horovod", {"HOROVOD_FUSION_THRESHOLD": "0"}),
    "torch": ("torch", {}),
}
"""Each job: the library it runs and the environment it adds."""
CASES = ("one tensor", "model's tensors")


def gradient_shapes(widths: Sequence[int]) -> list[tuple[int, ...]]:
    """The shapes of the benchmarks' MLP's gradients (``bench.mlp``), in its parameters' order."""
    model = bench.mlp(widths[0], widths[1:-1], widths[-1])
    return [tuple(parameter.shape) for parameter in model.parameters()]


# ------------------------------------------------------------------------------------------ worker
Allreduce = Callable[[list[torch.Tensor], str], list[torch.Tensor]]
"""Sums the tensors over every worker (their names are for Horovod) and returns the results."""


def _timed(
    rounds: int, tensors: list[torch.Tensor], allreduce: Allreduce, name: str, own: float, expected: float
) -> list[float]:
    """Seconds of each timed round of summing ``tensors`` filled with ``own`` (filled before the clock
    starts); every result must equal ``expected`` everywhere."""
    seconds = []
    for index in range(WARMUP + rounds):
        for tensor in tensors:
            tensor.fill_(own)
        started = time.perf_counter()
        results = allreduce(tensors, name)
        elapsed = time.perf_counter() - started
        for result in results:
            if not torch.all(result == expected):
                raise AssertionError(f"an allreduce returned {result.flatten()[:4].tolist()}..., expected {expected}")
        if index >= WARMUP:
            seconds.append(elapsed)
    return seconds


def worker_main(library: str, widths: Sequence[int], rounds: int, port: int, out: Path) -> None:
    """Time ``library``'s allreduce of both cases; the rank and size are horovodrun's."""
    bench.one_thread_per_worker()
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    shapes = gradient_shapes(widths)
    numel = sum(int(torch.Size(shape).numel()) for shape in shapes)
    cases = {CASES[0]: [torch.empty(numel)], CASES[1]: [torch.empty(shape) for shape in shapes]}
    expected = float(sum(range(1, size + 1)))  # rank r sends r + 1
    results: dict[str, Any] = {"numel": numel, "tensors": len(shapes)}
    if library == "horovod":
        import horovod.torch as hvd

        hvd.init()

        def allreduce(tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
            handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"{name}.{i}") for i, t in enumerate(tensors)]
            return [hvd.synchronize(handle) for handle in handles]

        barrier: Callable[[], None] = hvd.barrier
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)

        def allreduce(tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
            works = [dist.all_reduce(t, async_op=True) for t in tensors]
            for work in works:
                work.wait()
            return tensors

        barrier = dist.barrier
    for index, (case, tensors) in enumerate(cases.items()):
        results[case] = _timed(rounds, tensors, allreduce, f"case{index}", rank + 1, expected)
        barrier()
    if library == "torch":
        dist.destroy_process_group()
    write_rank_file(out, rank, results)


# ------------------------------------------------------------------------------------------ driver
def free_port() -> int:
    """A port free now, for torch's rendezvous (rank 0 binds it moments later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def measure(widths: Sequence[int], rounds: int, workdir: Path) -> dict[str, dict[str, Any]]:
    """Rank 0's results of each job of ``JOBS``."""
    outcomes = {}
    for job, (library, env) in JOBS.items():
        out = workdir / f"job{len(outcomes)}"
        script = [str(Path(__file__).resolve()), "--worker", library, "--widths", ",".join(map(str, widths)),
                  "--iterations", str(rounds)]  # fmt: skip
        script += ["--port", str(free_port())] if library == "torch" else []
        outcome = bench.horovodrun(script, out, np=2, timeout=600, env=dict(env)).check(f"gloo_allreduce job {job!r}")
        if 0 not in outcome.results:
            raise RuntimeError(f"rank 0 of job {job!r} wrote no result:\n{outcome.output[-3000:]}")
        outcomes[job] = outcome.results[0]
    return outcomes


def _spread_ms(seconds: Sequence[float]) -> tuple[float, str]:
    """Median and the 10th-90th percentile, in ms."""
    deciles = statistics.quantiles(seconds, n=10) if len(seconds) > 1 else [seconds[0]] * 9
    return 1e3 * statistics.median(seconds), f"{1e3 * deciles[0]:.1f}-{1e3 * deciles[-1]:.1f}"


def report(widths: Sequence[int], rounds: int, outcomes: dict[str, dict[str, Any]]) -> str:
    rows = []
    first = next(iter(outcomes.values()))
    torch_ms = {case: _spread_ms(outcomes["torch"][case])[0] for case in CASES}
    for case in CASES:
        for job, results in outcomes.items():
            median_ms, spread = _spread_ms(results[case])
            rows.append([case, job, f"{median_ms:.1f}", spread, f"{median_ms / torch_ms[case]:.2f}"])
    header = (
        f"gloo_allreduce: 2 workers on CPU, 1 thread each, one library per job; Sum of {first['numel']:,} float32 "
        f"({first['numel'] * 4 / 2**20:.1f} MiB: the gradients of MLP {'-'.join(map(str, widths))}) as one tensor "
        f"or as its {first['tensors']} tensors, all started before any is awaited; {rounds} timed rounds after "
        f"{WARMUP} untimed, rank 0; ms = median, p10-p90 beside it."
    )
    table = format_table(["tensors", "job", "ms", "p10-p90", "/ torch"], rows)
    return f"{header}\n\n{table}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="small tensors, few rounds; writes no report")
    parser.add_argument("--iterations", type=int, help="timed rounds per case (default 20; 3 with --smoke)")
    parser.add_argument(
        "--report",
        type=Path,
        help="write the table here (default: docs/benchmarks/gloo_allreduce.txt; none with --smoke)",
    )
    parser.add_argument("--worker", choices=("horovod", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--widths", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rounds = args.iterations if args.iterations is not None else (3 if args.smoke else 20)
    if rounds < 1:
        parser.error(f"--iterations {rounds} must be >= 1")
    if args.worker:
        worker_main(args.worker, [int(w) for w in args.widths.split(",")], rounds, args.port, args.out)
        return 0
    widths = SMOKE_WIDTHS if args.smoke else FULL_WIDTHS
    with tempfile.TemporaryDirectory(prefix="hvd_gloo_allreduce_") as tmp:
        text = report(widths, rounds, measure(widths, rounds, Path(tmp)))
    publish_report(text, __file__, argv, args.report, None if args.smoke else "gloo_allreduce.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
