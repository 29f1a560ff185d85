"""Which transport should carry the node-local and cross-node legs of a two-level allreduce?

Compares, under real ``horovodrun`` jobs on 2 nodes x 1 worker and 2 nodes x 2 workers (emulated
on one machine with ``-H localhost:N,127.0.0.1:N``):

- ``dynamic``: Horovod's dynamic process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1`` +
  ``hvd.add_process_set``);
- ``static_env``: static sets passed to ``hvd.init`` and derived from each rank's launcher
  variables (``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_SIZE``: host-major numbering assumed), the
  assumption checked after start-up with an allgather (``layout_ok``);
- ``static``: plain start, layout gathered, restart with static sets only when some are needed;
- ``alltoall``: the package's way (``comm.partners``): no process sets at all, each leg is a
  global ``hvd.alltoall`` whose splits are non-zero only towards the partners of that leg;
- ``flat``: plain ``hvd.init()`` and one global allreduce only (the ``global`` column of
  ``alltoall`` measures the same, so it is left out unless asked for).

For a small (1k) and a large (1M element) float32 buffer each job times every leg (node-local
reduce-scatter ``rs``, cross-node allreduce ``xr``, node-local allgather ``ag``), the full
two-level allreduce ``two_level`` and the flat global allreduce ``global`` under that start-up.
Each configuration runs ``--repeats`` times as separate jobs, round-robin over transports; the
table shows the median over jobs of each job's median, the spread (min-max of the job medians)
and how many jobs failed or timed out. Run ``python benchmarks/transport.py`` or ``--smoke``
(one job, both transports in turn).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing.benchmarking import horovodrun, median
from hvd_plugins.testing.launch import read_rank_files, write_rank_file
from hvd_plugins.testing.reports import publish_report, write_report

TRANSPORTS = ("flat", "dynamic", "static_env", "static", "alltoall")
DEFAULT_TRANSPORTS = ("dynamic", "static_env", "static", "alltoall")  # alltoall's global column is plain init's
LAYOUTS = {"2x1": (2, "localhost:1,127.0.0.1:1"), "2x2": (4, "localhost:2,127.0.0.1:2")}
SIZES = {"1k": 1_000, "1M": 1_000_000}
ROUNDS = {"1k": 40, "1M": 8}  # timed rounds per measurement, after 2 untimed ones
MEASURES = ("global", "rs", "xr", "ag", "two_level")
JOB_TIMEOUT_S = 150.0
GLOO_TIMEOUT_S = "60"


# ---------------------------------------------------------------------------------------- worker
def start(transport: str) -> tuple[Any, dict[str, Any]]:
    """Start Horovod as ``transport`` does; return hvd and ``{"local": set, "cross": set, ...}``."""
    import horovod.torch as hvd

    from hvd_plugins.core.comm.topology import discover_topology

    begin = time.perf_counter()
    info: dict[str, Any] = {"layout_ok": True}
    if transport == "dynamic":
        groups = start_with_dynamic_sets(hvd)
    elif transport == "static_env":
        local_size, cross_size = int(os.environ["HOROVOD_LOCAL_SIZE"]), int(os.environ["HOROVOD_CROSS_SIZE"])
        world = local_size * cross_size
        nodes = [list(range(n * local_size, (n + 1) * local_size)) for n in range(cross_size)]
        cross = [list(range(i, world, local_size)) for i in range(local_size)]
        needed = nodes + cross if local_size > 1 and cross_size > 1 else []
        sets = [hvd.ProcessSet(ranks) for ranks in needed]
        hvd.init(process_sets=sets)
        topology = discover_topology()  # the check: does the gathered layout equal the assumed one?
        info["layout_ok"] = [list(node) for node in topology.nodes] == nodes
        by_ranks = {tuple(ranks): s for ranks, s in zip(needed, sets, strict=True)}
        groups = {
            "local": by_ranks.get(topology.nodes[topology.node_index], hvd.global_process_set),
            "cross": by_ranks.get(topology.cross_ranks(topology.local_rank), hvd.global_process_set),
            "topology": topology,
        }
    elif transport == "static":
        groups = start_with_static_sets(hvd)
    else:  # flat, alltoall: no process sets
        hvd.init()
        topology = discover_topology()
        groups = {"local": None, "cross": None, "topology": topology}
    info["init_s"] = time.perf_counter() - begin
    return hvd, {**groups, **info}


def node_sets(topology: Any) -> list[tuple[int, ...]]:
    """The node and cross-node sets of a layout, where they are neither the global set nor single workers."""
    cross = [topology.cross_ranks(i) for i in range(topology.local_size)]
    return [*topology.nodes, *cross] if topology.num_nodes > 1 and topology.local_size > 1 else []


def groups_of(topology: Any, sets: dict[tuple[int, ...], Any]) -> dict[str, Any]:
    return {
        "local": sets.get(topology.nodes[topology.node_index]),
        "cross": sets.get(topology.cross_ranks(topology.local_rank)),
        "topology": topology,
    }


def start_with_dynamic_sets(hvd: Any) -> dict[str, Any]:
    """Dynamic mode, the layout gathered, the node and cross-node sets added."""
    from hvd_plugins.core.comm.topology import discover_topology

    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.init()
    topology = discover_topology()
    return groups_of(topology, {ranks: hvd.add_process_set(list(ranks)) for ranks in node_sets(topology)})


def start_with_static_sets(hvd: Any) -> dict[str, Any]:
    """Plain start, gather the layout, restart with the node and cross-node sets where needed."""
    from hvd_plugins.core.comm.topology import discover_topology

    hvd.init()
    topology = discover_topology()
    needed = node_sets(topology)
    sets = [hvd.ProcessSet(list(ranks)) for ranks in needed]
    if sets:
        hvd.barrier()
        hvd.shutdown()
        time.sleep(2.0)  # every rank's shutdown reaches the rendezvous server before any restarts
        hvd.init(process_sets=sets)
    return groups_of(topology, dict(zip(needed, sets, strict=True)))


def set_legs(hvd: Any, groups: dict[str, Any]) -> dict[str, Callable[[Any], Any]]:
    """The three legs with process sets (reduce-scatter, allreduce, allgather)."""
    local, cross = groups["local"] or hvd.global_process_set, groups["cross"] or hvd.global_process_set
    return {
        "rs": lambda t: hvd.reducescatter(t, op=hvd.Sum, process_set=local, name="rs"),
        "xr": lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=cross, name="xr"),
        "ag": lambda t: hvd.allgather(t, process_set=local, name="ag"),
    }


def alltoall_legs(hvd: Any, groups: dict[str, Any]) -> dict[str, Callable[[Any], Any]]:
    """The three legs as the package runs them: global alltoalls that send only to the leg's partners."""
    from hvd_plugins.core.comm import partners
    from hvd_plugins.core.comm.compression import NoCompression
    from hvd_plugins.core.comm.counters import CommCounters, Scope
    from hvd_plugins.core.comm.topology import build_node_groups

    node_groups = build_node_groups(groups["topology"])
    local, cross, codec = node_groups.local, node_groups.cross, NoCompression()
    legs: dict[str, Callable[[Any], Any]] = {}
    if local is not None:
        legs["rs"] = lambda t: partners.finish_reduce_scatter(partners.start_reduce_scatter(t, local, codec, "rs"))
        legs["ag"] = lambda t: partners.finish_allgather(partners.start_allgather(t, local, codec, "ag"))
    if cross is not None:
        legs["xr"] = lambda t: partners.group_sum([t], cross, codec, "xr", CommCounters(), Scope.CROSS_NODE)[0]
    return legs


STEP_MODELS = {"small": (32, [64], 10), "large": (512, [1024, 1024], 10)}  # features, hidden, classes
STEP_SYNCS = ("allreduce", "hierarchical")
STEP_BATCH, STEP_BATCHES, STEP_WARMUP = 64, 25, 5


def step_worker(sync: str, out: Path) -> None:
    """Train each STEP_MODELS model one epoch with ``sync``; record the median seconds per step."""
    import torch

    from hvd_plugins import HorovodStrategy
    from hvd_plugins.testing import benchmarking as bench

    bench.one_thread_per_worker()
    result: dict[str, Any] = {}
    for label, (features, hidden, classes) in STEP_MODELS.items():
        clock = bench.StepClock()
        trainer = bench.cpu_trainer(HorovodStrategy(sync=sync), [clock])
        module = bench.Classifier(features, hidden, classes, lr=0.01)
        world = trainer.world_size
        data = bench.random_classification(STEP_BATCH * STEP_BATCHES * world, features, classes)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=STEP_BATCH))
        intervals = [b - a for a, b in zip(clock.times[STEP_WARMUP:], clock.times[STEP_WARMUP + 1 :], strict=False)]
        result[label] = statistics.median(intervals) * 1e3
        result[f"{label}.wait"] = trainer.strategy.comm_counters.wait_seconds * 1e3 / max(1, trainer.global_step)
        result[f"{label}.parameters"] = bench.parameter_count(module)
        rank = trainer.global_rank
    write_rank_file(out, rank, result)


def step_times(repeats: int) -> str:
    """Milliseconds per training step, flat vs hierarchical, on 2x2; jobs round-robin over the syncs."""
    np, hosts = LAYOUTS["2x2"]
    measured: dict[str, list[dict[str, Any]]] = {sync: [] for sync in STEP_SYNCS}
    failures: dict[str, int] = dict.fromkeys(STEP_SYNCS, 0)
    for _ in range(repeats):
        for sync in STEP_SYNCS:
            with tempfile.TemporaryDirectory() as out:
                script = [str(Path(__file__).resolve()), "--step-worker", sync]
                job = horovodrun(script, Path(out), np=np, hosts=hosts, timeout=300)
                results = read_rank_files(Path(out))
            if job.returncode == 0 and 0 in results:
                measured[sync].append(results[0])
            else:
                failures[sync] += 1
                errors = [line for line in job.output.splitlines() if "Error" in line or "rror:" in line]
                print(f"{sync} failed (exit {job.returncode}):", *errors[-6:], sep="\n", flush=True)
    rows = []
    for label in STEP_MODELS:
        for sync in STEP_SYNCS:
            values = [job[label] for job in measured[sync]]
            waits = [job[f"{label}.wait"] for job in measured[sync]]
            parameters = measured[sync][0][f"{label}.parameters"] if measured[sync] else "-"
            cell = f"{median(values):.3g} ({spread(values)})" if values else "-"
            wait = f"{median(waits):.3g}" if waits else "-"
            rows.append([label, parameters, sync, cell, wait, f"{failures[sync]}/{repeats}"])
    headers = ["model", "parameters", "sync", "ms per step", "wait ms per step", "failed"]
    return "\n".join(
        [
            f"2x2 training step, rank 0, median of steps after {STEP_WARMUP}; median over {repeats} jobs (min-max);",
            "wait = time blocked in the gradient collectives (comm counters), mean per step.",
            format_table(headers, rows),
        ]
    )


def timed(op: Callable[[], Any], rounds: int) -> float:
    """Median milliseconds of one ``op()`` over ``rounds`` rounds (after 2 untimed ones)."""
    times = []
    for index in range(rounds + 2):
        begin = time.perf_counter()
        op()
        if index >= 2:
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def worker(transports: Sequence[str], sizes: Sequence[str], out: Path) -> None:
    """Measure under each transport in turn (Horovod shut down between them); one rank file holds them all."""
    import torch

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    rank = 0
    for transport in transports:
        rank, results[transport] = measure_transport(transport, sizes)
    write_rank_file(out, rank, results)


def measure_transport(transport: str, sizes: Sequence[str]) -> tuple[int, dict[str, Any]]:
    """This rank and its timings under ``transport`` (see the module docstring), Horovod shut down after."""
    import torch

    hvd, groups = start(transport)
    topology = groups["topology"]
    legs = alltoall_legs(hvd, groups) if transport == "alltoall" else set_legs(hvd, groups)
    local_size = topology.local_size
    result: dict[str, Any] = {"init_s": groups["init_s"], "layout_ok": groups["layout_ok"]}
    for label in sizes:
        numel = SIZES[label] - SIZES[label] % local_size
        buffer = torch.randn(numel, generator=torch.Generator().manual_seed(hvd.rank()))
        shard = buffer[: numel // local_size].clone()
        rounds = ROUNDS[label]

        def two_level(b: torch.Tensor = buffer) -> torch.Tensor:
            part = legs["rs"](b) if local_size > 1 else b
            part = legs["xr"](part) if topology.num_nodes > 1 else part
            return legs["ag"](part) if local_size > 1 else part

        result[f"{label}.global"] = timed(lambda b=buffer: hvd.allreduce(b, op=hvd.Sum, name="global"), rounds)
        if transport != "flat":
            if local_size > 1:
                result[f"{label}.rs"] = timed(lambda b=buffer: legs["rs"](b), rounds)
                result[f"{label}.ag"] = timed(lambda s=shard: legs["ag"](s), rounds)
            if topology.num_nodes > 1:
                result[f"{label}.xr"] = timed(lambda s=shard: legs["xr"](s), rounds)
            result[f"{label}.two_level"] = timed(two_level, rounds)
            reference = hvd.allreduce(buffer, op=hvd.Sum, name="check")
            result[f"{label}.correct"] = bool(torch.allclose(two_level(), reference, rtol=1e-4, atol=1e-3))
    rank = hvd.rank()
    hvd.shutdown()
    os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)  # the next transport of the job starts plainly
    return rank, result


# ---------------------------------------------------------------------------------------- driver
def run_job(layout: str, transports: Sequence[str], sizes: Sequence[str], outcomes: dict[str, Any]) -> None:
    """One job of one layout, ``transports`` in turn; adds rank 0's numbers, or the failure, to each outcome."""
    np, hosts = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as out:
        script = [str(Path(__file__).resolve()), "--worker", "--transport", *transports, "--sizes", *sizes]
        job = horovodrun(
            script, Path(out), np=np, hosts=hosts, timeout=JOB_TIMEOUT_S * len(transports),
            env={"HOROVOD_GLOO_TIMEOUT_SECONDS": GLOO_TIMEOUT_S},
        )  # fmt: skip
        results = read_rank_files(Path(out))
    for transport in transports:
        if job.timed_out:
            outcomes[transport]["failures"].append("timeout")
        elif job.returncode != 0 or sorted(results) != list(range(np)):
            outcomes[transport]["failures"].append(_failure_reason(job.output))
        else:
            outcomes[transport]["jobs"].append(results[0][transport])


def _failure_reason(output: str) -> str:
    for marker in ("Timed out", "timeout", "Connection", "Error"):
        if marker in output:
            return marker.lower()
    return "exit"


def spread(values: Sequence[float]) -> str:
    return f"{min(values):.3g}-{max(values):.3g}" if values else "-"


def rows_of(layout: str, transport: str, outcome: dict[str, Any], sizes: Sequence[str]) -> list[list[Any]]:
    jobs, failures = outcome["jobs"], outcome["failures"]
    rows = []
    for label in sizes:
        row: list[Any] = [layout, transport, label]
        for measure in MEASURES:
            values = [job[f"{label}.{measure}"] for job in jobs if f"{label}.{measure}" in job]
            row.append(f"{median(values):.3g} ({spread(values)})" if values else "-")
        checks = [job.get(f"{label}.correct", True) and job["layout_ok"] for job in jobs]
        init = [job["init_s"] for job in jobs]
        row += [f"{median(init):.2f}" if init else "-", "yes" if all(checks) else "NO"]
        row.append(f"{len(failures)}/{len(jobs) + len(failures)} {','.join(sorted(set(failures)))}".strip())
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--transport", nargs="+", choices=TRANSPORTS, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5, help="separate jobs per configuration")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(DEFAULT_TRANSPORTS))
    parser.add_argument(
        "--report", type=Path, help="write the table here (default: docs/benchmarks/transport.txt; none with --smoke)"
    )
    parser.add_argument("--append", action="store_true", help="add to the report, not replace it")
    parser.add_argument(
        "--smoke", action="store_true", help="2x1, 1k, static and alltoall in turn in one job; writes no report"
    )
    parser.add_argument(
        "--step-times", action="store_true", help="only time training steps, flat vs hierarchical (report: --report)"
    )
    parser.add_argument("--step-worker", choices=STEP_SYNCS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.transport, args.sizes, args.out)
        return 0
    if args.step_worker:
        step_worker(args.step_worker, args.out)
        return 0
    if args.step_times:
        text = step_times(args.repeats)
        print(text)
        if args.report is not None:
            print(f"written to {write_report(args.report, text, __file__, argv, append=args.append)}")
        return 0
    if args.smoke:  # the package's transport and one with process sets, unless others are asked for
        args.layouts, args.sizes, args.repeats = ["2x1"], ["1k"], 1
        if args.transports == list(DEFAULT_TRANSPORTS):
            args.transports = ["static", "alltoall"]
    # Round-robin over transports, one job each, so a change in the machine's load hits every transport
    # alike; the smoke runs them in turn in one job (it checks that each works, not what it costs).
    jobs = [args.transports] if args.smoke else [[transport] for transport in args.transports]
    begin = time.monotonic()
    rows = []
    for layout in args.layouts:
        outcomes: dict[str, dict[str, Any]] = {t: {"jobs": [], "failures": []} for t in args.transports}
        for repeat in range(args.repeats):
            for transports in jobs:
                run_job(layout, transports, args.sizes, outcomes)
            print(f"{layout} repeat {repeat + 1}/{args.repeats} done", flush=True)
        for transport, outcome in outcomes.items():
            rows += rows_of(layout, transport, outcome, args.sizes)
    headers = ["layout", "transport", "size", *[f"{m} ms" for m in MEASURES], "init s", "correct", "failed"]
    text = "\n".join(
        [
            "Milliseconds per collective, rank 0: median over jobs of each job's median (min-max of the job medians).",
            f"{args.repeats} job(s) per row; float32 buffers; emulated nodes on loopback (noisy).",
            "alltoall starts Horovod plainly (no process sets): its global column is plain hvd.init()'s allreduce.",
            "global = flat allreduce under that start-up; rs/xr/ag = node-local reduce-scatter, cross-node",
            "allreduce of a 1/L shard, node-local allgather; two_level = the three legs in a row.",
            "",
            format_table(headers, rows),
            "",
            f"total {time.monotonic() - begin:.0f} s",
        ]
    )
    publish_report(text, __file__, argv, args.report, None if args.smoke else "transport.txt", append=args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
