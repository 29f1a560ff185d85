"""What an allreduce of gradients costs, and how exact it is, in float32, float16 and bfloat16.

Each job starts N workers on this machine (``horovodrun --gloo``, or ``mpirun`` for Horovod's MPI
controller), one thread each. Every worker holds the same 64 MiB of float32 "gradients" (16 Mi
elements) scaled by its own factor, with magnitudes spread log-uniformly over 1e-9..1e5: the
range where float16 underflows to zero at the small end and overflows at the large end, and
where a gradient of a large model lives. Each worker casts them to the wire type, sums them with
one ``hvd.allreduce`` (``op=Sum``), ``--rounds`` timed rounds after ``WARMUP`` untimed, and
compares the sum cast to float64 with the float64 sum of the float32 inputs:

- ``median rel. error``: the median over elements of ``|sum - reference| / |reference|``;
- ``lost``: elements whose sum came back zero, infinite or NaN where the reference is none of these.

Bytes are the payload each worker hands Horovod per allreduce (what the strategy's counters record).
This benchmark needs a Horovod that takes bfloat16 (``hvd-build-horovod``).

    python benchmarks/wire_dtypes.py            # writes docs/benchmarks/wire_dtypes.txt
    python benchmarks/wire_dtypes.py --smoke    # 2 workers, Gloo, small tensors; no report
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

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import mpi_launch_problem, mpirun, write_rank_file
from hvd_plugins.testing.reports import publish_report

WARMUP = 2
FULL_ELEMENTS = 16 * 2**20
"""64 MiB of float32."""
SMOKE_ELEMENTS = 4096
WIRE_TYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def gradients(elements: int, rank: int) -> torch.Tensor:
    """The float32 values worker ``rank`` sums: one shared pattern, scaled per worker."""
    generator = torch.Generator().manual_seed(0)
    magnitude = torch.pow(10.0, torch.empty(elements).uniform_(-9, 5, generator=generator))
    signs = torch.randn(elements, generator=generator).sign()
    return (signs * magnitude * (1 + 0.25 * rank)).float()


# ------------------------------------------------------------------------------------------ worker
def worker_main(elements: int, rounds: int, out: Path) -> None:
    import horovod.torch as hvd

    bench.one_thread_per_worker()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    values = gradients(elements, rank)
    reference = sum(gradients(elements, r).double() for r in range(size))
    assert isinstance(reference, torch.Tensor)
    results: dict[str, Any] = {}
    for name, dtype in WIRE_TYPES.items():
        wire = values.to(dtype)
        seconds = []
        for index in range(WARMUP + rounds):
            started = time.perf_counter()
            summed = hvd.allreduce(wire, op=hvd.Sum, name=f"wire.{name}")
            if index >= WARMUP:
                seconds.append(time.perf_counter() - started)
        got = summed.double()
        usable = reference != 0
        lost = usable & ((got == 0) | ~torch.isfinite(got))
        error = ((got - reference).abs() / reference.abs())[usable & ~lost]
        results[name] = {
            "ms": 1e3 * statistics.median(seconds),
            "bytes": wire.numel() * wire.element_size(),
            "median_error": float(error.median()),
            "lost": int(lost.sum()),
        }
    write_rank_file(out, rank, results)


# ------------------------------------------------------------------------------------------ driver
def job(controller: str, workers: int, elements: int, rounds: int, out: Path) -> dict[str, Any]:
    script = [str(Path(__file__).resolve()), "--worker", "--elements", str(elements), "--rounds", str(rounds)]
    if controller == "gloo":
        result = bench.horovodrun(script, out, np=workers, timeout=900)
    else:
        result = mpirun([sys.executable, *script], np=workers, hosts=f"localhost:{workers}", out_dir=out, timeout=900)
    result.check(f"wire_dtypes, {controller}, {workers} workers")
    return result.results[0]


def report(rows: list[list[str]], elements: int, rounds: int, skipped: str) -> str:
    header = (
        f"wire_dtypes: hvd.allreduce(op=Sum) of {elements:,} gradients ({elements * 4 / 2**20:.0f} MiB as float32) "
        f"cast to the wire type, N workers on this machine, one thread each; ms = rank 0's median of {rounds} "
        f"rounds after {WARMUP}. Magnitudes log-uniform over 1e-9..1e5; error against the float64 sum of the "
        f"float32 inputs; lost = zero, inf or NaN where the reference is not.{skipped}"
    )
    table = format_table(["controller", "N", "wire", "MiB sent", "ms", "median rel. error", "lost"], rows)
    return f"{header}\n\n{table}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 workers, Gloo, small tensors; writes no report")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per wire type (default 10)")
    parser.add_argument("--report", type=Path, help="write the table here instead of docs/benchmarks/")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--elements", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be >= 1")
    if args.worker:
        worker_main(args.elements, args.rounds, args.out)
        return 0
    elements, rounds = (SMOKE_ELEMENTS, 2) if args.smoke else (FULL_ELEMENTS, args.rounds)
    controllers = ["gloo"] if args.smoke else ["gloo", "mpi"]
    skipped = ""
    if "mpi" in controllers and (problem := mpi_launch_problem()):
        controllers.remove("mpi")
        skipped = f" MPI skipped: {problem}."
    rows = []
    with tempfile.TemporaryDirectory(prefix="wire_dtypes_") as workdir:
        for controller in controllers:
            for workers in [2] if args.smoke else [2, 4]:
                result = job(controller, workers, elements, rounds, Path(workdir) / f"{controller}{workers}")
                for name, measured in result.items():
                    rows.append([
                        controller, str(workers), name, f"{measured['bytes'] / 2**20:.0f}", f"{measured['ms']:.1f}",
                        f"{measured['median_error']:.1e}", f"{measured['lost']:,}",
                    ])  # fmt: skip
                    print("  " + "  ".join(rows[-1]), flush=True)
    publish_report(report(rows, elements, rounds, skipped), __file__, argv, args.report,
                   None if args.smoke else "wire_dtypes.txt")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
