"""What a checkpoint of a fully sharded GPT costs: whole, in torch's format (DCP), and DCP in the background.

A GPT of about 400 M parameters (``TiedGPT``, pythia-410m's width and vocabulary) is built on the meta device on
4 workers (two emulated hosts of two), sharded with ``shard="parameters"``, and takes one step of SGD with
momentum (one state tensor per parameter, so the whole state is twice the model). Then ``fabric.save`` writes:

- ``full``: one file from rank 0 (``state_dict_type="full"``, the default): the model gathered unit by unit, the
  optimizer state allgathered on every worker;
- ``sharded``: a DCP directory, every worker writing its own shards (``state_dict_type="sharded"``);
- ``async``: the same, with ``async_save=True``: the save returns once staged in host memory.

For each, the table gives the time until the checkpoint is complete on disk, how long training stopped for it
(the whole save, or until ``fabric.save`` returned), the step time while the background write runs, and the
saving worker's peak resident memory growth (rank 0, which writes the whole file). Then a job of 4 workers and
one of 2 load each checkpoint into a fresh ZeRO-3 model and optimizer (``fabric.load``), a job per checkpoint.

    python benchmarks/checkpoint_dcp.py            # the 400 M GPT: writes docs/benchmarks/checkpoint_dcp.txt
    python benchmarks/checkpoint_dcp.py --smoke    # a tiny GPT: checks that every setting runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

SAVES = ("full", "sharded", "async")
MODEL = {"vocab": 50304, "d_model": 1024, "layers": 28, "heads": 16, "context": 64}
"""About 405 M parameters: 1.5 GiB in float32, and as much again of momentum."""
SMOKE_MODEL = {"vocab": 64, "d_model": 16, "layers": 2, "heads": 2, "context": 16}
HOSTS = "localhost:2,127.0.0.1:2"
GIB = 2**30


def set_up(size: dict[str, Any], save: str) -> tuple[Any, Any, Any, Any]:
    """A fresh ZeRO-3 Fabric job with the GPT built on the meta device and SGD with momentum."""
    import torch
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    sharded = {"state_dict_type": "sharded", "async_save": save == "async"} if save != "full" else {}
    fabric = Fabric(strategy=HorovodStrategy(shard="parameters", **sharded), accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = bench.TiedGPT(**size)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    tokens = torch.randint(0, size["vocab"], (1, size["context"] + 1), generator=torch.Generator().manual_seed(0))
    return fabric, model, optimizer, tokens


def train_step(fabric: Any, model: Any, optimizer: Any, tokens: Any) -> float:
    """One SGD step; its seconds."""
    import torch

    start = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def save_worker(args: argparse.Namespace) -> None:
    size = json.loads(args.size)
    fabric, model, optimizer, tokens = set_up(size, args.save)
    train_step(fabric, model, optimizer, tokens)
    step = train_step(fabric, model, optimizer, tokens)  # the step time without a save
    path = Path(args.path)
    fabric.barrier()
    bench.reset_peak()
    before = bench.resident()["VmRSS"]
    start = time.perf_counter()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    stopped = time.perf_counter() - start
    during = train_step(fabric, model, optimizer, tokens) if args.save == "async" else 0.0
    if args.save == "async":
        fabric.strategy.wait_for_checkpoint()
    fabric.barrier()
    complete = time.perf_counter() - start
    peak = bench.resident()["VmHWM"] - before
    write_rank_file(
        args.out,
        fabric.global_rank,
        {"step": step, "stopped": stopped, "during": during, "complete": complete, "peak": peak},
    )


def load_worker(args: argparse.Namespace) -> None:
    size = json.loads(args.size)
    fabric, model, optimizer, _ = set_up(size, "full")
    found = {}
    for name in [args.save]:  # one checkpoint a job: what a load holds is not hidden by an earlier load's heap
        fabric.barrier()
        bench.reset_peak()
        before = bench.resident()["VmRSS"]
        start = time.perf_counter()
        fabric.load(Path(args.path) / name, {"model": model, "optimizer": optimizer})
        found[name] = time.perf_counter() - start
        found[f"{name} peak"] = bench.resident()["VmHWM"] - before
    write_rank_file(args.out, fabric.global_rank, found)


def run(size: dict[str, Any], workdir: Path) -> str:
    rows = []
    saved: dict[str, dict[str, float]] = {}
    script = [__file__, "--size", json.dumps(size)]
    for save in SAVES:
        job = bench.horovodrun(
            [*script, "--worker", "save", "--save", save, "--path", str(workdir / save)],
            workdir / f"out_{save}",
            np=4,
            hosts=HOSTS,
            timeout=1800,
        )
        if sorted(job.results) != [0, 1, 2, 3]:
            rows.append([save, "failed", job.output[-200:].replace("\n", " "), "", "", ""])
            continue
        reports = [job.results[rank] for rank in range(4)]
        saved[save] = {key: max(report[key] for report in reports) for key in reports[0]}
        saved[save]["peak"] = reports[0]["peak"]
        print(f"  {save}: {saved[save]}", flush=True)
    loads: dict[int, dict[str, float]] = {}
    for workers in (4, 2):
        for name in SAVES[:2]:
            job = bench.horovodrun(
                [*script, "--worker", "load", "--save", name, "--path", str(workdir)],
                workdir / f"load_{name}_{workers}",
                np=workers,
                hosts=HOSTS if workers == 4 else None,
                timeout=1800,
            )
            if sorted(job.results) == list(range(workers)):
                keys = job.results[0]
                found = {key: max(job.results[r][key] for r in range(workers)) for key in keys}
                loads.setdefault(workers, {}).update(found)
        print(f"  load at {workers}: {loads.get(workers)}", flush=True)
    for save, found in saved.items():
        read = "full" if save == "full" else "sharded"
        rows.append(
            [
                save,
                f"{found['complete']:.1f}",
                f"{found['stopped']:.1f}",
                f"{found['during']:.1f} (alone {found['step']:.1f})" if save == "async" else f"{found['step']:.1f}",
                f"{found['peak'] / GIB:.2f}",
                f"{loads[4][read]:.1f} ({loads[4][read + ' peak'] / GIB:.2f})" if 4 in loads else "failed",
                f"{loads[2][read]:.1f} ({loads[2][read + ' peak'] / GIB:.2f})" if 2 in loads else "failed",
            ]
        )
    header = ("save", "to disk s", "training stopped s", "step s", "rank 0 peak GiB", "load at 4 s (GiB)", "at 2")
    return (
        f"Model: TiedGPT {size}; 4 workers on two emulated hosts, shard='parameters', SGD with momentum.\n"
        "to disk: from fabric.save until the checkpoint is in place on every worker; training stopped: until "
        "fabric.save returned; step: a training step (for async, the one run while the files are written); "
        "rank 0 peak: its resident memory growth during the save; load: fabric.load into a fresh ZeRO-3 model "
        "and optimizer, the largest worker's time and, in brackets, its peak resident memory growth.\n\n"
        + format_table(header, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=("save", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--save", choices=SAVES, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT: checks that every setting runs")
    parser.add_argument("--report", type=Path, help="write the report here instead of docs/benchmarks/")
    args = parser.parse_args(argv)
    if args.worker:
        bench.one_thread_per_worker()
        (save_worker if args.worker == "save" else load_worker)(args)
        return 0
    given = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(dir=Path.home()) as workdir:
        text = run(SMOKE_MODEL if args.smoke else MODEL, Path(workdir))
    publish_report(text, __file__, given, args.report, None if args.smoke else "checkpoint_dcp.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
