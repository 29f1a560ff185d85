"""HorovodStrategy against torch's own tools, on the same model, data and machine, in one invocation.

Every variant is a plain training loop (forward, backward, step) on a decoder-only Transformer, one
thread per worker, all workers on this host over Gloo:

=================  ===================================================  ==========================
torch              launched with ``python -m torch.distributed.run``     ours (``horovodrun``, Fabric)
=================  ===================================================  ==========================
``ddp``            ``DistributedDataParallel``                            ``flat``: ``HorovodStrategy()``
``ddp_zero``       DDP with ``ZeroRedundancyOptimizer``                  ``zero1``: ``shard="optimizer"``
``fsdp2_keep``     ``fully_shard`` per block, ``reshard_after_forward=False``  ``zero2``: ``shard="gradients"``
``fsdp2_reshard``  ``fully_shard`` per block, ``reshard_after_forward=True``   ``zero3``: ``shard="parameters"``
=================  ===================================================  ==========================

``no_comm`` runs the same loop in N processes that never talk: the compute limit on this machine.
Each variant reports the median over repeats of its step time, its peak resident memory (the
largest worker's), and the bytes this host's loopback carried per step and worker (every byte the
workers sent each other, the launcher's and Horovod's negotiation included). Ours are given as
ratios to their torch counterpart: speed = torch's step time / ours (>= 1.0 is as fast or faster),
memory = ours / torch's (<= 1.0 is as little or less). Launch order rotates between repeats.

A second table, where a step's time goes: each variant's time over the no-communication floor and the
CPU its threads used per step. ``--rounds`` looks inside Horovod instead: the ``flat`` variant runs with
Horovod's timeline (``HOROVOD_TIMELINE_MARK_CYCLES=1``), once with the loop as the strategy sets it and
once with a round every cycle (``HOROVOD_IDLE_CYCLE_TIME=0``, as a stock Horovod), and rank 0's timeline
gives per step the loop's rounds, the allreduces, their wait from enqueue until every worker had them,
the fusion buffer's copies and Gloo's ring.

    python benchmarks/versus_torch.py            # full run: writes docs/benchmarks/versus_torch.txt
    python benchmarks/versus_torch.py --rounds   # Horovod's timeline: writes docs/benchmarks/sync_rounds.txt
    python benchmarks/versus_torch.py --smoke    # tiny and fast: checks that every variant runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report
from hvd_plugins.testing.timeline import allreduce_breakdown, read_timeline

TORCH_VARIANTS = ("ddp", "ddp_zero", "fsdp2_keep", "fsdp2_reshard")
OUR_VARIANTS: dict[str, dict[str, Any]] = {
    "flat": {},
    "zero1": {"shard": "optimizer"},
    "zero2": {"shard": "gradients"},
    "zero3": {"shard": "parameters", "auto_wrap_policy": {bench.TransformerBlock}},  # each block a unit, as FSDP2's
}
COUNTERPART = {"flat": "ddp", "zero1": "ddp_zero", "zero2": "fsdp2_keep", "zero3": "fsdp2_reshard"}
"""Each of our variants and the torch variant it is weighed against."""
NO_COMM = "no_comm"
LOOPS: dict[str, dict[str, str]] = {"sleeps when idle": {}, "every cycle": {"HOROVOD_IDLE_CYCLE_TIME": "0"}}
"""Horovod's loop as the strategy sets it (a round only while a collective is queued, patch 0017), and a round
every 1 ms cycle, work or not, as a stock Horovod runs it."""


@dataclass(frozen=True)
class Model:
    """A ``TransformerLM`` shape, the sequences each worker trains on per step, and which variants run on it."""

    name: str
    size: tuple[tuple[str, int], ...]
    batch_size: int
    variants: tuple[str, ...]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.size)


ALL = (*TORCH_VARIANTS, *OUR_VARIANTS, NO_COMM)
FULL_MODELS = (
    # GPT-like: 6 blocks of width 384, 4096 tokens, context 128 (12.3 M parameters, tied head).
    Model("gpt", (("vocab", 4096), ("d_model", 384), ("layers", 6), ("heads", 6), ("context", 128)), 8, ALL),
    # The benchmarks' Transformer: 2.7 M parameters in 260 tensors (many small gradients).
    Model("transformer", (("vocab", 2048), ("d_model", 112), ("layers", 16), ("heads", 4), ("context", 64)), 16,
          ("ddp", "flat", NO_COMM)),
)  # fmt: skip
SMOKE_MODELS = (Model("tiny", (("vocab", 128), ("d_model", 32), ("layers", 2), ("heads", 2), ("context", 16)), 4, ALL),)


# ------------------------------------------------------------------------------------------ worker
def _loopback_bytes() -> int:
    """Bytes this host's loopback interface has sent so far (0 where Linux does not tell)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])
    except (OSError, IndexError, ValueError):
        pass
    return 0


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _copied_bytes(fabric: Any) -> int:
    """Gradient bytes our strategy has copied on the training thread so far, into buckets and back (0 for torch)."""
    return int(fabric.strategy.comm_counters.copied_bytes) if fabric is not None else 0


def _batches(sizes: dict[str, int], batch_size: int, rank: int) -> list[torch.Tensor]:
    """A few fixed batches of random tokens, different on every rank (context + 1 tokens: inputs and targets)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, sizes["vocab"], (batch_size, sizes["context"] + 1), generator=generator) for _ in range(4)]


def _model(sizes: dict[str, int]) -> bench.TransformerLM:
    return bench.TransformerLM(**sizes)


def _torch_setup(variant: str, sizes: dict[str, int]) -> tuple[torch.nn.Module, torch.optim.Optimizer, int, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(sizes)
    if variant in ("ddp", "ddp_zero"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        wrapped: torch.nn.Module = DistributedDataParallel(model)
        if variant == "ddp_zero":
            optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=model.lr, weight_decay=0.01
            )
        else:
            optimizer = model.configure_optimizers()
        return wrapped, optimizer, rank, world
    from torch.distributed.fsdp import fully_shard

    reshard = variant == "fsdp2_reshard"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model, model.configure_optimizers(), rank, world


def _our_setup(variant: str, sizes: dict[str, int]) -> tuple[Any, Any, Any, int, int]:
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    fabric = Fabric(accelerator="cpu", strategy=HorovodStrategy(**OUR_VARIANTS[variant]))
    fabric.launch()
    model = _model(sizes)
    wrapped, optimizer = fabric.setup(model, model.configure_optimizers())
    return fabric, wrapped, optimizer, fabric.global_rank, fabric.world_size


def run_worker(args: argparse.Namespace) -> None:
    bench.one_thread_per_worker()
    sizes: dict[str, int] = json.loads(args.size)
    idle_rss = _peak_rss_mib()
    fabric = None
    if args.worker in TORCH_VARIANTS:
        model, optimizer, rank, world = _torch_setup(args.worker, sizes)
    elif args.worker in OUR_VARIANTS:
        fabric, model, optimizer, rank, world = _our_setup(args.worker, sizes)
    else:  # no_comm: the same work, no process group
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        model = _model(sizes)
        optimizer = model.configure_optimizers()
    init_rss = _peak_rss_mib()
    batches = _batches(sizes, args.batch_size, rank)
    step_ends: list[float] = []
    sent_at_warmup = 0
    copied_at_warmup = 0
    cpu_at_warmup: dict[int, float] = {}
    for step in range(args.steps):
        tokens = batches[step % len(batches)]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if fabric is not None:
            fabric.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_ends.append(time.perf_counter())
        if step + 1 == args.warmup_steps:
            sent_at_warmup = _loopback_bytes()
            copied_at_warmup = _copied_bytes(fabric)
            cpu_at_warmup = bench.thread_cpu_seconds()
    timed_steps = args.steps - args.warmup_steps
    cpu = bench.cpu_by_role(cpu_at_warmup, bench.thread_cpu_seconds(), timed_steps)
    sent = (_loopback_bytes() - sent_at_warmup) / timed_steps / world if rank == 0 else 0.0
    write_rank_file(
        Path(args.out),
        rank,
        {
            "step_s": 1 / bench.steps_per_second(step_ends, args.warmup_steps - 1),
            "peak_rss_mib": _peak_rss_mib(),
            "idle_rss_mib": idle_rss,
            "init_rss_mib": init_rss,
            "sent_per_step": sent,
            "copied_per_step": (_copied_bytes(fabric) - copied_at_warmup) / timed_steps,
            "parameters": sum(p.numel() for p in _model(sizes).parameters()),
            "world": world,
            **cpu,
        },
    )
    if args.worker in TORCH_VARIANTS:  # torch's gloo threads can abort a process as it ends ("terminate called")
        import torch.distributed as dist

        dist.barrier()  # every rank's results are written: end here, before the interpreter tears gloo down
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ------------------------------------------------------------------------------------------ driver
def _launch(
    variant: str, model: Model, world: int, steps: int, warmup: int, out: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    script = [str(Path(__file__).resolve()), f"--worker={variant}", f"--size={json.dumps(model.sizes)}",
              f"--batch-size={model.batch_size}", f"--steps={steps}", f"--warmup-steps={warmup}"]  # fmt: skip
    if variant in OUR_VARIANTS:
        job = bench.horovodrun(script, out, np=world, timeout=900, env=env)
    else:
        job = bench.torchrun(script, out, nproc=world, timeout=900)
    job.check(f"{variant} on {model.name}, {world} workers")
    ranks = job.results
    if len(ranks) != world:
        raise RuntimeError(f"{variant} on {model.name}: {len(ranks)} of {world} workers reported\n{job.output[-3000:]}")
    return {
        "step_s": max(r["step_s"] for r in ranks.values()),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks.values()),
        "init_rss_mib": max(r["init_rss_mib"] for r in ranks.values()),
        "sent_per_step": ranks[0]["sent_per_step"],
        "copied_per_step": ranks[0].get("copied_per_step", 0.0),
        "parameters": ranks[0]["parameters"],
        **{key: bench.median([r[key] for r in ranks.values()]) for key in bench.CPU_ROLES},
    }


def measure(models: Sequence[Model], worlds: Sequence[int], repeats: int, steps: int, warmup: int) -> dict:
    """``{(model, world, variant): [one result per repeat]}``; the launch order rotates between repeats."""
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(repeats):
            for model in models:
                for world in worlds:
                    order = list(model.variants)
                    shift = repeat % len(order)
                    for variant in order[shift:] + order[:shift]:
                        out = Path(scratch) / f"{model.name}-{world}-{variant}-{repeat}"
                        result = _launch(variant, model, world, steps, warmup, out)
                        results.setdefault((model.name, world, variant), []).append(result)
                        step_ms, peak = result["step_s"] * 1000, result["peak_rss_mib"]
                        print(f"  {model.name} N={world} {variant:14s} repeat {repeat + 1}: {step_ms:7.1f} ms/step, "
                              f"{peak:6.0f} MiB", flush=True)  # fmt: skip
    return results


def measure_rounds(models: Sequence[Model], worlds: Sequence[int], steps: int, warmup: int) -> str:
    """The flat sync under Horovod's timeline, with each of ``LOOPS``: one run each, the table of what it read."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in models:
            for world in worlds:
                for loop, loop_env in LOOPS.items():
                    out, timeline = Path(scratch) / f"run{len(rows)}", Path(scratch) / f"timeline{len(rows)}.json"
                    env = {"HOROVOD_TIMELINE": str(timeline), "HOROVOD_TIMELINE_MARK_CYCLES": "1", **loop_env}
                    result = _launch("flat", model, world, steps, warmup, out, env)
                    found = allreduce_breakdown(read_timeline(timeline), steps)
                    rows.append([model.name, str(world), loop, f"{result['step_s'] * 1000:.0f}",
                                 f"{found['rounds']:.1f}", f"{found['allreduces']:.1f}", f"{found['negotiate']:.1f}",
                                 f"{found['copies']:.1f}", f"{found['ring']:.1f}",
                                 f"{result['cpu_busiest_ms'] + result['cpu_rest_ms']:.0f}"])  # fmt: skip
                    print("  " + "  ".join(rows[-1]), flush=True)
    headers = ["model", "N", "Horovod's loop", "ms/step", "rounds", "allreduces", "negotiate ms", "copies ms",
               "ring ms", "other threads' CPU ms"]  # fmt: skip
    legend = (
        f"Per step, from rank 0's timeline ({steps} steps, the first allreduce's enqueue to the last one's end; the "
        "timeline's writing\nslows the step): rounds of Horovod's loop, gradient allreduces, their wait from enqueue "
        "until every worker had them (summed),\nthe fusion buffer's copies, Gloo's ring allreduce; other threads' CPU: "
        "every thread but the training thread, per worker."
    )
    return format_table(headers, rows) + "\n\n" + legend


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return bench.median([run[key] for run in runs])


def _cost_table(model: Model, worlds: Sequence[int], results: dict) -> str:
    """Each variant's step time over the no-communication floor, and the CPU its threads used per step."""
    rows = []
    for world in worlds:
        floor_runs = results.get((model.name, world, NO_COMM))
        floor = _median(floor_runs, "step_s") if floor_runs else None
        for variant in model.variants:
            runs = results[(model.name, world, variant)]
            step = _median(runs, "step_s")
            over = "-" if floor is None or variant == NO_COMM else f"{(step - floor) * 1000:.0f}"
            copied = f"{_median(runs, 'copied_per_step') / 2**20:.1f}" if variant in OUR_VARIANTS else "-"
            rows.append([str(world), variant, f"{step * 1000:.0f}", over,
                         *(f"{_median(runs, key):.0f}" for key in bench.CPU_ROLES), copied])  # fmt: skip
    headers = ["N", "variant", "step", "over no_comm", "CPU main", "CPU busiest other", "CPU rest", "MiB copied"]
    return format_table(headers, rows)


def report(models: Sequence[Model], worlds: Sequence[int], results: dict, repeats: int) -> str:
    sections = []
    for model in models:
        parameters = next(runs for (name, _, _), runs in results.items() if name == model.name)[0]["parameters"]
        rows = []
        for world in worlds:
            for variant in model.variants:
                runs = results[(model.name, world, variant)]
                step, rss = _median(runs, "step_s"), _median(runs, "peak_rss_mib")
                torch_variant = COUNTERPART.get(variant)
                speed = memory = "-"
                if torch_variant is not None and (model.name, world, torch_variant) in results:
                    theirs = results[(model.name, world, torch_variant)]
                    speed = f"{_median(theirs, 'step_s') / step:.2f}x"
                    memory = f"{rss / _median(theirs, 'peak_rss_mib'):.2f}x"
                vs = f"vs {torch_variant}" if torch_variant else ""
                rows.append([str(world), variant, vs, f"{step * 1000:.0f}", speed, f"{rss:.0f}",
                             f"{_median(runs, 'init_rss_mib'):.0f}", memory,
                             f"{_median(runs, 'sent_per_step') / 2**20:.2f}"])  # fmt: skip
        headers = ["N", "variant", "against", "ms/step", "speed", "peak MiB", "idle MiB", "memory", "MiB sent/step"]
        sections.append(
            f"{model.name}: TransformerLM {model.sizes}, {parameters / 1e6:.1f} M parameters, "
            f"{model.batch_size} sequences per worker and step; medians of {repeats}\n" + format_table(headers, rows)
        )
        sections.append(f"{model.name}: where a step goes, per worker (ms)\n" + _cost_table(model, worlds, results))
    legend = (
        "speed: torch's step time / ours (>= 1.00x: as fast or faster); memory: our peak / torch's (<= 1.00x: as "
        "little or less).\npeak MiB: the largest worker's peak resident memory; idle MiB: the same after import and "
        "setup, before the first step;\nMiB sent/step: loopback bytes per step and worker (all traffic between the "
        "workers).\nwhere a step goes: over no_comm = step time minus the no-communication floor; CPU = CPU time "
        "per step of the training thread,\nthe busiest other thread (Horovod's or torch's process group's: "
        "negotiation, Gloo's ring and transport) and the other threads;\nMiB copied: gradient bytes our strategy "
        "copied per step on the training thread, into its buckets and back out (comm_counters.copied_bytes)."
    )
    return "\n\n".join([*sections, legend])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=ALL, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=14, help="steps per run (default 14)")
    parser.add_argument("--warmup-steps", type=int, default=4, help="untimed first steps (default 4)")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one repeat: checks that every variant runs")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every variant (default 3; medians)")
    parser.add_argument("--models", nargs="+", help="only these models (default: all)")
    parser.add_argument("--variants", nargs="+", choices=ALL, help="only these variants (default: each model's)")
    parser.add_argument("--rounds", action="store_true", help="the flat sync under Horovod's timeline, both loops")
    parser.add_argument("--report", type=Path, help="write the report here (default docs/benchmarks/versus_torch.txt)")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    models: tuple[Model, ...] = SMOKE_MODELS if args.smoke else FULL_MODELS
    if args.models:
        models = tuple(model for model in models if model.name in args.models)
    if args.variants:
        models = tuple(
            Model(m.name, m.size, m.batch_size, tuple(v for v in m.variants if v in args.variants)) for m in models
        )
    repeats = 1 if args.smoke else args.repeats
    steps, warmup = (4, 2) if args.smoke else (args.steps, args.warmup_steps)
    partial = args.smoke or args.models or args.variants
    if args.rounds:
        text = measure_rounds(models, args.workers, steps, warmup)
        publish_report(text, __file__, argv, args.report, None if partial else "sync_rounds.txt")
        return 0
    results = measure(models, args.workers, repeats, steps, warmup)
    text = report(models, args.workers, results, repeats)
    publish_report(text, __file__, argv, args.report, None if partial else "versus_torch.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
