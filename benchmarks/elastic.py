"""What elastic training costs and how fast it recovers, on the large benchmark MLP.

An elastic ``horovodrun`` (``--host-discovery-script``) runs four workers on two hosts of this
machine (``localhost:2`` and ``127.0.0.1:2``), one intra-op thread each, training the MLP
256-1024-512-10 (793,098 parameters) with Adam on 32 samples per worker and step, through
``Trainer(strategy=HorovodStrategy(...))``.

- **Commit cost**: a run without failures. Each commit (Lightning's checkpoint content copied to
  host memory, then Horovod's check for host changes) is timed in the workers, and so is every
  step that did not commit. Cost = commit time / (interval x step time), at the default interval.
- **Recovery**: a run in which the worker of rank 3 kills itself (SIGKILL) in the middle of the
  second commit interval and its host leaves the discovery output. Recovery is the time from its death to the survivors'
  next completed step, split into noticing it (the reset), starting Horovod again and restoring
  the commit, and that first step. Steps redone = the step it died at - the commit it resumed from.

- **Sharded** (``--shard optimizer|gradients|parameters``): the same runs with the optimizer state split
  over the workers (with ``parameters``, the units' parameters too). A commit keeps each worker's part
  and a copy of another's; its host memory per worker is compared with 2/N of what the parts hold
  whole (the aim), and the recovery includes laying it out again over the two survivors.

    python benchmarks/elastic.py                      # writes docs/benchmarks/elastic.txt
    python benchmarks/elastic.py --shard gradients    # writes docs/benchmarks/elastic_sharded.txt
    python benchmarks/elastic.py --shard parameters   # writes docs/benchmarks/elastic_zero3.txt
    python benchmarks/elastic.py --smoke              # a small model, one recovery; writes no report
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hvd_plugins.core.config import DEFAULT_COMMIT_EVERY_N_STEPS
from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import elastic_horovodrun
from hvd_plugins.testing.reports import publish_report

FULL_WIDTHS = (256, 1024, 512, 10)
SMOKE_WIDTHS = (16, 32, 4)
BATCH = 32
HOSTS = "localhost:2,127.0.0.1:2"
GROW_FROM = "localhost:1,127.0.0.1:1"
DISCOVERY = Path(__file__).resolve().parents[1] / "examples" / "elastic" / "discover_hosts_file.sh"
RECOVERY_AIM_SECONDS = 15.0
COMMIT_AIM_PERCENT = 3.0


# ------------------------------------------------------------------------------------------ worker
class Events:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, kind: str, **fields: Any) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"kind": kind, "time": time.time(), "pid": os.getpid(), **fields}) + "\n")


WAIT_FOR_JOIN_S = 0.25
"""A growing job's pause per step until the new workers join, so a short run cannot end before they
have started (they import torch and Lightning first); join times are wall times, not step times."""


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import lightning.pytorch as pl

    from hvd_plugins.pytorch import HorovodStrategy

    bench.one_thread_per_worker()
    events = Events(args.out / "events.jsonl")
    widths = SMOKE_WIDTHS if args.smoke else FULL_WIDTHS

    class Clock(pl.Callback):
        """Every step's time and whether it committed; the victim's death at ``--kill-step``."""

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            events.write("train_start", rank=hvd.rank(), size=hvd.size(), step=trainer.global_step)

        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *rest: Any) -> None:
            step = trainer.global_step
            marker = args.out / "killed"
            if step == args.kill_step and hvd.rank() == args.kill_rank and not marker.exists():
                marker.write_text(str(step))
                host = os.environ["HOROVOD_HOSTNAME"]  # its host leaves the job with it
                others = [line for line in args.hosts_file.read_text().split() if line.split(":")[0] != host]
                args.hosts_file.write_text("\n".join(others) + "\n")
                events.write("killed", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.grow_step and hvd.rank() == 0 and not marker.exists():
                marker.write_text(str(step))
                args.hosts_file.write_text(HOSTS.replace(",", "\n") + "\n")  # both hosts get a second slot
                events.write("grown", step=step)
            if 0 <= args.grow_step < step and hvd.size() < 4:
                time.sleep(WAIT_FOR_JOIN_S)  # keep the job alive until the new workers have started
            self.commits_before = len(strategy.elastic.commit_seconds) if strategy.elastic else 0
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *rest: Any) -> None:
            sliced = getattr(trainer.optimizers[0], "sliced_parameter_bytes", None)  # ZeRO-3: the units' slices
            self.unit_bytes = sliced() * hvd.size() if sliced is not None else 0
            committed = strategy.elastic is not None and len(strategy.elastic.commit_seconds) > self.commits_before
            seconds = time.perf_counter() - self.start
            events.write(
                "step", rank=hvd.rank(), size=hvd.size(), step=trainer.global_step, seconds=seconds, committed=committed
            )

    strategy = HorovodStrategy(commit_every_n_steps=args.commit_every, shard=args.shard)
    module = bench.Classifier(widths[0], widths[1:-1], widths[-1], lr=1e-3)
    module.configure_optimizers = lambda: torch.optim.Adam(module.parameters(), lr=1e-3)  # type: ignore[method-assign]
    clock = Clock()
    trainer = bench.cpu_trainer(strategy, [clock], max_epochs=-1)
    trainer.fit_loop.epoch_loop.max_steps = args.steps
    data = bench.random_classification(BATCH * 4 * 16, widths[0], widths[-1])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True))
    assert strategy.elastic is not None
    elastic = strategy.elastic
    held = elastic.held[1] if elastic.held is not None else []
    events.write(
        "end",
        rank=hvd.rank(),
        size=hvd.size(),
        commits=elastic.commit_seconds,
        copies=elastic.copy_seconds,
        held_bytes=sum(part.numel() for parts in held if parts for part in parts.values()),
        whole_state_bytes=2 * sum(p.numel() * p.element_size() for p in module.parameters()),  # Adam's two moments
        unit_bytes=getattr(clock, "unit_bytes", 0),  # ZeRO-3 commits the units' slices too
    )


# ------------------------------------------------------------------------------------------ driver
def launch(
    folder: Path, args: argparse.Namespace, kill_step: int = -1, grow_step: int = -1, steps: int = 0
) -> list[dict[str, Any]]:
    """One elastic job: 4 workers on ``HOSTS``, or with ``grow_step`` 2 workers on ``GROW_FROM`` that grow to 4."""
    folder.mkdir(parents=True, exist_ok=True)
    hosts_file = folder / "hosts"
    hosts_file.write_text((GROW_FROM if grow_step >= 0 else HOSTS).replace(",", "\n") + "\n")
    command = [sys.executable, __file__, "--worker", "--out", str(folder), "--hosts-file", str(hosts_file)]
    command += ["--steps", str(steps or args.steps), "--commit-every", str(args.commit_every)]
    command += ["--kill-step", str(kill_step), "--grow-step", str(grow_step), "--shard", args.shard]
    command += ["--smoke"] if args.smoke else []
    job = elastic_horovodrun(
        command,
        np=2 if grow_step >= 0 else 4,
        min_np=2,
        max_np=4,
        discovery_script=DISCOVERY,
        env={"HOSTS_FILE": str(hosts_file)},
        timeout=600,
    )
    if job.returncode != 0:
        raise RuntimeError(f"the elastic job failed (exit {job.returncode}):\n{job.output[-4000:]}")
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]


def commit_cost(events: list[dict[str, Any]], interval: int) -> dict[str, float]:
    steps = [e for e in events if e["kind"] == "step" and e["step"] > 2]
    plain = bench.median([e["seconds"] for e in steps if not e["committed"]])
    commits = [seconds for e in events if e["kind"] == "end" for seconds in e["commits"]]
    commit = bench.median(commits)
    copy = bench.median([seconds for e in events if e["kind"] == "end" for seconds in e["copies"]])
    ends = [e for e in events if e["kind"] == "end"]
    return {
        "held_mb": max(e["held_bytes"] for e in ends) / 2**20,
        "whole_state_mb": ends[0]["whole_state_bytes"] / 2**20,
        "unit_mb": ends[0].get("unit_bytes", 0) / 2**20,
        "workers": float(len(ends)),
        "step_ms": plain * 1e3,
        "commit_ms": commit * 1e3,
        "copy_ms": copy * 1e3,
        "percent": 100 * commit / (interval * plain),
    }


def recovery(events: list[dict[str, Any]]) -> dict[str, float]:
    (death,) = [e for e in events if e["kind"] == "killed"]
    resumed = [e for e in events if e["kind"] == "train_start" and e["time"] > death["time"]]
    first = min(resumed, key=lambda e: e["time"])
    after = min((e for e in events if e["kind"] == "step" and e["time"] > first["time"]), key=lambda e: e["time"])
    return {
        "restart_s": first["time"] - death["time"],
        "first_step_s": after["time"] - first["time"],
        "total_s": after["time"] - death["time"],
        "redone": death["step"] - first["step"],
    }


def joining(events: list[dict[str, Any]]) -> dict[str, float]:
    """From the hosts' second slots appearing to the first step of four workers."""
    (grown,) = [e for e in events if e["kind"] == "grown"]
    four = [e for e in events if e["kind"] == "train_start" and e["size"] == 4]
    started = min(e["time"] for e in four)
    stepped = min(e["time"] for e in events if e["kind"] == "step" and e["size"] == 4)
    return {"noticed_s": started - grown["time"], "first_step_s": stepped - started, "total_s": stepped - grown["time"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a small model and one recovery; no report")
    parser.add_argument("--repeats", type=int, default=3, help="recoveries measured (default 3)")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default 120, smoke 30)")
    parser.add_argument("--commit-every", type=int, default=0, help=f"default {DEFAULT_COMMIT_EVERY_N_STEPS}, smoke 5")
    parser.add_argument(
        "--shard", default="none", choices=["none", "optimizer", "gradients", "parameters"], help="sharded runs"
    )
    parser.add_argument("--kill-step", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--grow-step", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, default=None, help="where to write the report")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hosts-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kill-rank", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (30 if args.smoke else 120)
    args.commit_every = args.commit_every or (5 if args.smoke else DEFAULT_COMMIT_EVERY_N_STEPS)
    if args.worker:
        worker(args)
        return 0
    repeats = 1 if args.smoke else args.repeats
    kill_step = args.commit_every + args.commit_every // 2 + 1  # the middle of the second interval
    with tempfile.TemporaryDirectory(prefix="hvd_elastic_bench_") as folder:
        steady = commit_cost(launch(Path(folder) / "steady", args, kill_step=-1), args.commit_every)
        recoveries = [recovery(launch(Path(folder) / f"kill{i}", args, kill_step)) for i in range(repeats)]
        # the hosts grow at step 2 and are noticed at a commit: enough steps for the new workers to start first
        grow_steps = 200 if args.smoke else 2 * args.steps
        joins = [
            joining(launch(Path(folder) / f"grow{i}", args, grow_step=2, steps=grow_steps)) for i in range(repeats)
        ]
    total = statistics.median(r["total_s"] for r in recoveries)
    rows = [
        ["step (no commit)", f"{steady['step_ms']:.1f} ms", ""],
        ["commit", f"{steady['commit_ms']:.1f} ms", ""],
        ["  of it: snapshot copied to host memory", f"{steady['copy_ms']:.1f} ms", ""],
        [
            f"commit cost, every {args.commit_every} steps",
            f"{steady['percent']:.2f} %",
            f"aim < {COMMIT_AIM_PERCENT:g} %: {bench.target_verdict(steady['percent'], COMMIT_AIM_PERCENT, False)}",
        ],
        ["death to Horovod restarted, commit restored", fmt_spread([r["restart_s"] for r in recoveries]), ""],
        ["first step after it", fmt_spread([r["first_step_s"] for r in recoveries]), ""],
        [
            "recovery: death to next completed step",
            fmt_spread([r["total_s"] for r in recoveries]),
            f"aim < {RECOVERY_AIM_SECONDS:g} s: {bench.target_verdict(total, RECOVERY_AIM_SECONDS, False)}",
        ],
        ["steps redone", " ".join(str(r["redone"]) for r in recoveries), ""],
        *held_rows(steady, args.shard),
        ["hosts grow: listed to 4 workers restored", fmt_spread([j["noticed_s"] for j in joins]), ""],
        ["join: listed to the first step of 4 workers", fmt_spread([j["total_s"] for j in joins]), ""],
    ]
    widths = SMOKE_WIDTHS if args.smoke else FULL_WIDTHS
    sharded = f", shard={args.shard!r}" if args.shard != "none" else ""
    title = (
        f"elastic{sharded}: 4 workers on 2 hosts of this machine, MLP {'-'.join(map(str, widths))}, Adam, {BATCH} "
        f"samples per worker and step; rank 3 killed at step {kill_step}, its host leaves, 2 workers go on "
        f"({repeats} recoveries; medians, the runs in brackets). Join: 2 workers on {GROW_FROM}, both hosts get a "
        f"second slot at step 2, noticed at the next commit"
    )
    table = format_table(["", "measured", ""], rows)
    name = {"none": "elastic.txt", "parameters": "elastic_zero3.txt"}.get(args.shard, "elastic_sharded.txt")
    publish_report(f"{title}\n\n{table}", __file__, argv or sys.argv[1:], args.report, None if args.smoke else name)
    return 0


def held_rows(steady: dict[str, float], shard: str) -> list[list[str]]:
    """Sharded: the optimizer state a commit keeps per worker, against the aim of 2/N of the whole state."""
    if shard == "none":
        return []
    kept = steady["whole_state_mb"] + steady["unit_mb"]  # ZeRO-3: the units' parameters live in the slices too
    aim = 2 / steady["workers"] * kept
    units = [["units' parameters, whole (as slices)", f"{steady['unit_mb']:.3f} MB", ""]] if steady["unit_mb"] else []
    return [
        ["optimizer state, whole", f"{steady['whole_state_mb']:.3f} MB", ""],
        *units,
        [
            "commit keeps per worker (own part + a copy)",
            f"{steady['held_mb']:.3f} MB",
            f"aim <= 2/N = {aim:.3f} MB: {bench.target_verdict(steady['held_mb'], aim * 1.01, False)}",
        ],
    ]


def fmt_spread(values: list[float]) -> str:
    runs = ", ".join(f"{value:.2f}" for value in values)
    return f"{statistics.median(values):.2f} s" + (f" ({runs})" if len(values) > 1 else "")


if __name__ == "__main__":
    sys.exit(main())
