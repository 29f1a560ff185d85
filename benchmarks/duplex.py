"""Why do cross-node pairs relay? One Gloo connection used both ways at once over a slow link, against one way.

On 2 emulated nodes x 2 workers (network namespaces, ``tc tbf`` between them, as in
``emulated_cluster.py``) every worker holds ``--mb`` MB of float32; each measurement is the
slowest rank's time (max over ranks) of one collective, ``--trials`` times after one untimed:

- ``flat``: Horovod's ring allreduce of the whole buffer over the 4 workers (it sends 1.5x the
  two-level legs' bytes across the link but uses each connection one way);
- ``exchange``: each cross-node pair (same local rank) exchanges half the buffer both ways at
  once on its one connection, then adds (one round);
- ``relay``: the same sum relayed, two one-way rounds, neighbouring pairs in opposite directions
  (``hvd_plugins.core.comm.partners``);
- ``one_way``: only one pair sends, only one way, the whole buffer (the link's own rate);
- ``two_level``: ``hierarchical_allreduce_`` of the whole buffer (reduce-scatter in the node,
  relay across nodes, allgather in the node).

    python benchmarks/duplex.py                        # 50 Mbit/s and unshaped, 3.2 MB, 10 trials
    python benchmarks/duplex.py --link-mbit 50,200 --mb 8

Needs root (namespaces). Prints a table (median, spread, MB/s through one node's link) and writes
it to ``--report`` (default ``docs/benchmarks/duplex.txt``) unless ``--no-save``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing.netns_cluster import (
    SKIP_EXIT_CODE,
    ClusterUnavailable,
    NamespaceCluster,
    parse_link,
    run_on_cluster,
    shaping_for,
)
from hvd_plugins.testing.reports import docs_dir, write_report

OPS = ("flat", "exchange", "relay", "one_way", "two_level")


def node_link_bytes(op: str, buffer_bytes: float) -> float:
    """Bytes that cross one node's link for ``op`` (2 nodes x 2 workers, ``buffer_bytes`` per worker)."""
    if op == "flat":
        return 2 * 3 / 4 * buffer_bytes  # ring over 4 workers: one hop per node leaves the node
    return buffer_bytes  # two halves leave each node; one_way: one whole buffer, one direction


def worker(out: Path, numel: int, trials: int) -> None:
    import horovod.torch as hvd
    import torch

    from hvd_plugins.core.comm.compression import NoCompression
    from hvd_plugins.core.comm.partners import GroupSum, start_one_way
    from hvd_plugins.core.comm.topology import build_node_groups, start_horovod_and_discover
    from hvd_plugins.core.comm.two_level import hierarchical_allreduce_

    torch.set_num_threads(1)
    groups = build_node_groups(start_horovod_and_discover(hvd))
    cross = groups.cross
    assert cross is not None and cross.relays, "duplex.py needs 2 nodes x 2 workers"
    buffer = torch.randn(numel)
    half = buffer[: numel // 2].clone()
    codec = NoCompression()
    sends_one_way = cross.relay_lane == 0 and cross.rank == cross.first_sender

    def one_way() -> None:
        handle = start_one_way(buffer, cross.partner if sends_one_way else None, cross.world, "duplex.one_way")
        hvd.synchronize(handle)

    ops: dict[str, Callable[[], Any]] = {
        "flat": lambda: hvd.allreduce(buffer, op=hvd.Sum, name="duplex.flat"),
        "exchange": lambda: GroupSum(half, cross, codec, "duplex.exchange", relay=False).wait(),
        "relay": lambda: GroupSum(half, cross, codec, "duplex.relay").wait(),
        "one_way": one_way,
        "two_level": lambda: hierarchical_allreduce_([buffer.clone()], groups, average=False),
    }
    times: dict[str, list[float]] = {}
    for name, op in ops.items():
        times[name] = []
        for trial in range(trials + 1):
            hvd.barrier()
            start = time.perf_counter()
            op()
            elapsed = torch.tensor([time.perf_counter() - start])
            slowest = hvd.allreduce(elapsed, op=hvd.Max, name=f"duplex.time.{name}").item()
            if trial:  # the first one warms up connections and buffers
                times[name].append(slowest)
    if hvd.rank() == 0:
        out.write_text(json.dumps(times))


def measure(link_mbit: float | None, megabytes: float, trials: int, workdir: Path) -> dict[str, list[float]]:
    out = workdir / f"duplex_{link_mbit}.json"
    numel = int(megabytes * 1e6 / 4) // 2 * 2
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), str(numel), str(trials)]
    with NamespaceCluster(nodes=2, shaping=shaping_for(link_mbit)) as cluster:
        run_on_cluster(cluster, command, workers_per_node=2, logs=workdir / f"logs_{link_mbit}", limit_s=600)
    return json.loads(out.read_text())


def rows_of(link: str, times: dict[str, list[float]], buffer_bytes: float) -> list[list[Any]]:
    rows = []
    for op in OPS:
        values = times[op]
        median_s = statistics.median(values)
        rows.append(
            [link, op, f"{1e3 * median_s:.0f}", f"{1e3 * min(values):.0f}-{1e3 * max(values):.0f}",
             f"{node_link_bytes(op, buffer_bytes) / 1e6 / median_s:.1f}"]
        )  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-mbit", default="50,unshaped", help="comma-separated rates in Mbit/s or 'unshaped'")
    parser.add_argument("--mb", type=float, default=3.2, help="float32 megabytes per worker (default 3.2)")
    parser.add_argument("--trials", type=int, default=10, help="timed trials per collective (default 10)")
    parser.add_argument("--report", type=Path, help="write the table here (default: docs/benchmarks/duplex.txt)")
    parser.add_argument("--no-save", action="store_true", help="print only; write no report")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker[0]), int(args.worker[1]), int(args.worker[2]))
        return 0
    if args.trials < 1 or args.mb <= 0:
        parser.error(f"--trials={args.trials} must be >= 1 and --mb={args.mb} must be > 0")
    try:
        links = [parse_link(text) for text in args.link_mbit.split(",")]
    except ValueError as error:
        parser.error(str(error))
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory(prefix="duplex_") as workdir:
        for link in links:
            try:
                times = measure(link, args.mb, args.trials, Path(workdir))
            except ClusterUnavailable as reason:
                print(f"duplex: skipped, {reason}")
                return SKIP_EXIT_CODE
            rows += rows_of("unshaped" if link is None else f"{link:g} Mbit/s", times, args.mb * 1e6)
    headers = ["link", "collective", "median ms", "min-max ms", "MB/s through a node's link"]
    text = (
        f"duplex: 2 nodes x 2 workers, {args.mb:g} MB float32 per worker, slowest rank, median of "
        f"{args.trials} trials\n\n" + format_table(headers, rows) + "\n"
    )
    print(text)
    if not args.no_save:
        print(f"written: {write_report(args.report or docs_dir(__file__) / 'duplex.txt', text, __file__, argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
