"""How long small collectives take with Horovod's timeline off and on, on one Horovod build or several.

Horovod's timeline (``HOROVOD_TIMELINE``, the timeline callback, Horovod's own test file) runs a
writer thread on rank 0. Each job here starts N workers with ``horovodrun --gloo`` on this machine,
one thread each, and every worker times ``--rounds`` blocking rounds of each of three small
collectives (an allreduce of 17 floats, an in-place broadcast of 17 floats, an alltoall of 16
floats), after ``WARMUP`` untimed ones. Timeline settings: ``off`` (unset), ``DYNAMIC`` (the writer
runs, nothing is recorded unless started) and ``file`` (recorded to a file). Each setting runs
``--repeats`` jobs, the settings in turn.

Besides the time per operation (the median over rounds, then over jobs) each worker reports the CPU
time its process spent per operation, and how much CPU its busiest thread other than the main one
took while the main thread slept for ``IDLE_S`` (with the timeline on: the writer's, on rank 0).

A build other than the Horovod this Python imports is given as ``--build NAME=DIR``, a folder
holding an installed ``horovod`` package (``pip install --no-deps --target DIR WHEEL``); its jobs
run with DIR first on ``PYTHONPATH``.

    python benchmarks/small_collectives.py --build "0001 only=/tmp/hvd0001"   # docs/benchmarks/small_collectives.txt
    python benchmarks/small_collectives.py --smoke                         # few rounds, 2 workers; no report
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

WARMUP = 200
"""Untimed rounds first: with 20 the first operation timed (the allreduce) still took 2-3x its settled time."""
IDLE_S = 1.0
TIMELINES = ("off", "DYNAMIC", "file")
OPERATIONS = ("allreduce", "broadcast", "alltoall")
THIS_BUILD = "this build"


# ------------------------------------------------------------------------------------------ worker
def busiest_other_thread(seconds: float) -> float:
    """The largest share of a core that any thread but the calling one took while it slept ``seconds``."""
    before = bench.thread_cpu_seconds()
    time.sleep(seconds)
    return bench.cpu_by_role(before, bench.thread_cpu_seconds(), steps=1)["cpu_busiest_ms"] / 1000 / seconds


def worker_main(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    bench.one_thread_per_worker()
    hvd.init()
    size = hvd.size()
    tensors = {
        "allreduce": lambda: hvd.allreduce(torch.ones(17), name="small.allreduce", op=hvd.Sum),
        "broadcast": lambda: hvd.broadcast_(torch.ones(17), root_rank=0, name="small.broadcast"),
        "alltoall": lambda: hvd.alltoall(torch.ones(16 * size), name="small.alltoall"),
    }
    result: dict[str, Any] = {"idle_thread_share": busiest_other_thread(IDLE_S)}
    for operation, run in tensors.items():
        for _ in range(WARMUP):
            run()
        times = []
        cpu = time.process_time()
        for _ in range(args.rounds):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        result[operation] = {
            "ms": 1e3 * statistics.median(times),
            "cpu_ms": 1e3 * (time.process_time() - cpu) / args.rounds,
        }
    from hvd_plugins.core.backend.build_marker import applied_patches

    result["patches"] = sorted(applied_patches())
    write_rank_file(args.out, hvd.rank(), result)


# ------------------------------------------------------------------------------------------ driver
def job(build: str, folder: str | None, timeline: str, workers: int, rounds: int, out: Path) -> dict[int, Any]:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))} if folder else {}
    if timeline == "DYNAMIC":
        env["HOROVOD_TIMELINE"] = "DYNAMIC"
    elif timeline == "file":
        env["HOROVOD_TIMELINE"] = str(out / "timeline.json")
    script = [str(Path(__file__).resolve()), "--worker", "--rounds", str(rounds)]
    result = bench.horovodrun(script, out, np=workers, timeout=600, env=env)
    result.check(f"{build}, {workers} workers, timeline {timeline}")
    return result.results


def measure(
    builds: dict[str, str | None], workers: Sequence[int], rounds: int, repeats: int, workdir: Path
) -> list[dict[str, Any]]:
    """Every (build, workers, timeline) setting ``repeats`` times, the settings of a worker count in turn."""
    runs: dict[tuple[str, int, str], list[dict[int, Any]]] = {}
    for count in workers:
        for repeat in range(repeats):
            for build, folder in builds.items():
                for timeline in TIMELINES:
                    out = workdir / f"{build.replace(' ', '_')}_{count}_{timeline}_{repeat}"
                    runs.setdefault((build, count, timeline), []).append(
                        job(build, folder, timeline, count, rounds, out)
                    )
    rows = []
    for (build, count, timeline), jobs in runs.items():
        row: dict[str, Any] = {"build": build, "workers": count, "timeline": timeline}
        for operation in OPERATIONS:
            row[operation] = statistics.median(
                statistics.median(ranks[r][operation]["ms"] for r in ranks) for ranks in jobs
            )
            row[f"{operation}_cpu"] = statistics.median(ranks[0][operation]["cpu_ms"] for ranks in jobs)
        row["idle_share"] = statistics.median(ranks[0]["idle_thread_share"] for ranks in jobs)
        row["patches"] = jobs[0][0]["patches"]
        rows.append(row)
        print(
            f"  {build:<12} N={count} timeline {timeline:<7} "
            + "  ".join(f"{op} {row[op]:.3f} ms" for op in OPERATIONS)
            + f"  idle thread {row['idle_share']:.0%}",
            flush=True,
        )
    return rows


def report(rows: list[dict[str, Any]], rounds: int, repeats: int) -> str:
    headers = ["build", "N", "timeline", *[f"{op} ms" for op in OPERATIONS], "rank 0 CPU ms/op", "rank 0 idle thread"]
    table = format_table(
        headers,
        [
            (
                row["build"],
                row["workers"],
                row["timeline"],
                *[f"{row[op]:.3f}" for op in OPERATIONS],
                f"{statistics.mean(row[f'{op}_cpu'] for op in OPERATIONS):.3f}",
                f"{row['idle_share']:.0%}",
            )
            for row in rows
        ],
    )
    builds = {row["build"]: ", ".join(p.split("-")[0] for p in row["patches"]) or "none" for row in rows}
    patches = "; ".join(f"{build}: patches {names}" for build, names in builds.items())
    return (
        f"small_collectives: N workers on this machine (horovodrun --gloo, localhost), one thread each; "
        f"{rounds} blocking rounds of each operation after {WARMUP}, median per worker, then over workers and "
        f"{repeats} job(s) a setting. allreduce: 17 float32, Sum; broadcast: 17 float32 in place; alltoall: 16 "
        f"float32 to each worker. CPU: rank 0's process, all threads, per operation (mean of the three). Idle "
        f"thread: the most CPU any thread but the main one took on rank 0 while the main thread slept {IDLE_S:g} s "
        f"(share of a core). Builds: {patches}.\n\n{table}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 workers, few rounds, one job a setting; no report")
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds of each operation (default 300)")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per setting (default 3)")
    parser.add_argument(
        "--build", action="append", default=[], help="NAME=DIR: another Horovod, installed in DIR (repeatable)"
    )
    parser.add_argument("--report", type=Path, help="write the report here instead of docs/benchmarks/")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    builds: dict[str, str | None] = {THIS_BUILD: None}
    for given in args.build:
        name, _, folder = given.partition("=")
        if not name or not folder or not (Path(folder) / "horovod" / "__init__.py").is_file():
            parser.error(f"--build {given!r}: give NAME=DIR, DIR a folder holding an installed horovod package")
        builds[name] = str(Path(folder).resolve())
    workers = [2] if args.smoke else [int(count) for count in args.workers.split(",") if count]
    rounds, repeats = (30, 1) if args.smoke else (args.rounds, args.repeats)
    with tempfile.TemporaryDirectory(prefix="small_collectives_") as workdir:
        rows = measure(builds, workers, rounds, repeats, Path(workdir))
    text = report(rows, rounds, repeats)
    given = sys.argv[1:] if argv is None else list(argv)
    publish_report(text, __file__, given, args.report, None if args.smoke else "small_collectives.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
