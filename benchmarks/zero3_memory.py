"""What a worker's resident memory grows by when a GPT is fully sharded, in each order users set it up.

A GPT of ``TransformerBlock`` s (a ``ModuleList``, so the default units are its blocks; embedding tied to the
output head) is built in ``init_module(empty_init=True)`` on 4 workers (two emulated hosts of two) and takes a
few SGD steps on 64 tokens, once per setting:

- ``none``: unsharded, ``fabric.setup(model, optimizer)``;
- ``together``: ``shard="parameters"``, ``fabric.setup(model, optimizer)``;
- ``model_first``: ``shard="parameters"``, ``fabric.setup(model)`` then ``fabric.setup_optimizers`` (litgpt's order);
- ``evaluate``: ``shard="parameters"``, ``fabric.setup(model)`` and forwards under ``no_grad``, no optimizer;
- ``predict``: ``shard="parameters"``, ``trainer.predict`` alone on a LightningModule built in
  ``trainer.init_module(empty_init=True)``;
- ``fsdp2``: torch's FSDP2 on the same model and steps, as torchtitan sets it up (built on the meta device,
  ``fully_shard`` per block and on the root, ``to_empty``, ``reset_parameters``, SGD), launched with
  ``torch.distributed.run`` over Gloo: the anchor the sharded settings are given as a ratio to.

Each worker reads its resident memory (``VmRSS``) before the model is built and after each phase, and its peak
(``VmHWM``, reset before the build); the table gives the largest growth over the workers. The aim: no worker's
resident memory grows by the model's float32 bytes under ``shard="parameters"``.

    python benchmarks/zero3_memory.py                 # the 400 M-parameter GPT; writes docs/benchmarks/zero3_memory.txt
    python benchmarks/zero3_memory.py --smoke         # a tiny GPT: checks that every setting runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

SETTINGS = ("none", "together", "model_first", "evaluate", "predict", "fsdp2")
MODEL = {"vocab": 50304, "d_model": 1024, "layers": 28, "heads": 16, "context": 64}
"""About 405 M parameters (pythia-410m's width and vocabulary, 28 blocks): 1.5 GiB in float32."""
SMOKE_MODEL = {"vocab": 64, "d_model": 16, "layers": 2, "heads": 2, "context": 16}
TRAINING = ("together", "model_first")
FSDP2_AIM = 0.85
"""Training under shard='parameters' peaks at most this much of FSDP2's growth on the same model and steps."""
HOSTS = "localhost:2,127.0.0.1:2"
WORKERS = 4
GIB = 2**30


def worker_main(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    bench.one_thread_per_worker()
    size = json.loads(args.size)

    def GPT() -> nn.Module:  # what the settings build, as they are handed a class
        return bench.TiedGPT(**size)

    with torch.device("meta"):  # no memory: what the units hold
        probe = GPT()
    block = sum(p.numel() for p in probe.blocks[0].parameters())
    largest_unit = max(block, sum(p.numel() for p in probe.parameters()) - len(probe.blocks) * block)
    tokens = torch.randint(0, size["vocab"], (1, size["context"] + 1), generator=torch.Generator().manual_seed(0))
    phases: dict[str, int] = {}
    bench.reset_peak()
    start = bench.resident()["VmRSS"]

    def note(phase: str, key: str = "VmRSS") -> None:
        phases[phase] = bench.resident()[key] - start

    if args.setting == "fsdp2":
        parameters = fsdp2_run(GPT, tokens, args.steps, note)
        rank = int(os.environ["RANK"])
    else:
        if args.setting == "predict":
            parameters = predict(GPT, tokens, note)
        else:
            parameters = fabric_run(GPT, tokens, args.setting, args.steps, note)
        import horovod.torch as hvd

        rank = hvd.rank()
    peak = bench.resident()["VmHWM"] - start
    write_rank_file(
        args.out, rank, {"phases": phases, "peak": peak, "parameters": parameters, "largest_unit": largest_unit}
    )


def next_token_loss(model: Any, tokens: Any) -> Any:
    """The model's cross-entropy on each next token of ``tokens``: the loss every training setting steps on."""
    import torch

    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def fabric_run(gpt: Any, tokens: Any, setting: str, steps: int, note: Any) -> int:
    import torch
    from lightning.fabric import Fabric

    from hvd_plugins.fabric import HorovodStrategy

    strategy = HorovodStrategy(shard="none") if setting == "none" else HorovodStrategy(shard="parameters")
    fabric = Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = gpt()
    parameters = sum(p.numel() for p in model.parameters())
    note("built")
    if setting in ("none", "together"):
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
        note("set up")
    else:
        model = fabric.setup(model)
        note("set up")
        if setting == "evaluate":
            with torch.no_grad():
                for _ in range(steps):
                    model(tokens[:, :-1])
            note("evaluated")
            return parameters
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-3))
        note("optimizer")
    for step in range(steps):
        loss = next_token_loss(model, tokens)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        note(f"step {step + 1}")
    return parameters


def fsdp2_run(gpt: Any, tokens: Any, steps: int, note: Any) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    with torch.device("meta"):
        model = gpt()
    parameters = sum(p.numel() for p in model.parameters())
    note("built")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    note("set up")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    note("optimizer")
    for step in range(steps):
        loss = next_token_loss(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        note(f"step {step + 1}")
    dist.destroy_process_group()
    return parameters


def predict(gpt: Any, tokens: Any, note: Any) -> int:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from hvd_plugins import HorovodStrategy

    class Predictor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt()

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            return self.gpt(batch[0]).argmax(-1)

    class BeforeTeardown(pl.Callback):
        """What the workers hold once predicting is done, before the strategy makes the model whole again."""

        def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            note("predicted")
            note("peak so far", "VmHWM")

    trainer = pl.Trainer(
        strategy=HorovodStrategy(shard="parameters"),
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[BeforeTeardown()],
    )
    with trainer.init_module(empty_init=True):
        module = Predictor()
    parameters = sum(p.numel() for p in module.parameters())
    note("built")
    trainer.predict(module, DataLoader(TensorDataset(tokens[:, :-1].repeat(WORKERS, 1)), batch_size=1))
    note("whole again")  # the model as the Trainer leaves it: whole on every worker
    return parameters


def run(size: dict[str, Any], steps: int, workdir: Path, settings: Sequence[str] = SETTINGS) -> str:
    measured: dict[str, tuple[int, str]] = {}  # setting -> (peak growth, growth after each phase)
    failed: dict[str, str] = {}
    model_bytes = unit_bytes = 0
    for setting in settings:
        out = workdir / setting
        script = [__file__, "--worker", "--setting", setting, "--size", json.dumps(size), "--steps", str(steps)]
        if setting == "fsdp2":
            job = bench.torchrun(script, out, nproc=WORKERS, timeout=1800)
        else:
            job = bench.horovodrun(script, out, np=WORKERS, hosts=HOSTS, timeout=1800)
        if sorted(job.results) != list(range(WORKERS)):
            failed[setting] = job.output[-200:].replace("\n", " ")
            continue
        reports = [job.results[rank] for rank in range(WORKERS)]
        model_bytes, unit_bytes = 4 * reports[0]["parameters"], 4 * reports[0]["largest_unit"]
        phases = {phase: max(report["phases"][phase] for report in reports) for phase in reports[0]["phases"]}
        peaks = [report["peak"] for report in reports]
        if setting == "predict":  # the peak before the model is made whole again at the end
            peaks = [report["phases"]["peak so far"] for report in reports]
        where = ", ".join(f"{phase} {value / GIB:.2f}" for phase, value in phases.items())
        measured[setting] = (max(peaks), where)
        print(f"  {setting}: peak growth {max(peaks) / GIB:.2f} GiB ({where})", flush=True)
    rows = [[setting, "failed", failed[setting], "", "", ""] for setting in settings if setting in failed]
    anchor = measured.get("fsdp2", (0, ""))[0]
    for setting, (peak, where) in measured.items():
        of_fsdp2 = f"{peak / anchor:.2f}x" if anchor and setting in ("none", *TRAINING) else ""
        rows.append(
            [
                setting,
                f"{peak / GIB:.2f}",
                f"{peak / model_bytes:.2f}x",
                of_fsdp2,
                where,
                verdict(setting, peak, model_bytes, anchor),
            ]
        )
    header = (
        "setting",
        "peak growth GiB",
        "of the model",
        "of FSDP2",
        "growth after each phase, GiB (largest worker)",
        "aim",
    )
    return (
        f"Model: {model_bytes / 4 / 1e6:.0f} M parameters, {model_bytes / GIB:.2f} GiB in float32; 4 workers on "
        f"two emulated hosts, SGD, batch 1 of {size['context']} tokens, {steps} steps.\n"
        "Resident memory each worker grew by over what it held "
        "before the model was built (the peak, and after each phase); aims under shard='parameters': less than the "
        f"model's float32 bytes, and, training, at most {FSDP2_AIM}x FSDP2's peak growth.\n\n"
        + format_table(header, rows)
        + "\n\n"
        + floor_note(model_bytes, unit_bytes, {s: measured[s][0] for s in TRAINING if s in measured})
    )


def floor_note(model_bytes: int, unit_bytes: int, peaks: dict[str, int]) -> str:
    """What a worker cannot hold less of while it trains sharded, and how far above it each training setting
    peaked: its slices, their gradients, and the largest unit whole with its gradient."""
    if not model_bytes:
        return "Nothing measured."
    slices = model_bytes / WORKERS
    floor = 2 * slices + 2 * unit_bytes
    above = ", ".join(f"{setting} {(peak - floor) / GIB:.2f} GiB above it" for setting, peak in peaks.items())
    return (
        f"Training sharded, a worker holds at least its slices ({slices / GIB:.2f} GiB), their gradients "
        f"({slices / GIB:.2f} GiB) and the largest unit whole with its gradient ({2 * unit_bytes / GIB:.2f} GiB): "
        f"{floor / GIB:.2f} GiB, {floor / model_bytes:.2f}x the model; {above or 'not measured'}. The rest: "
        "buckets in flight, the next unit prefetched, activations, and what the allocator keeps of freed buffers."
    )


def verdict(setting: str, peak: int, model_bytes: int, anchor: int) -> str:
    """Whether ``setting`` met its aims: under the model's bytes (sharded), and at most ``FSDP2_AIM`` of FSDP2's
    peak where it trains and FSDP2 was measured."""
    if setting in ("none", "fsdp2"):
        return ""
    missed = [f"model by {peak / model_bytes - 1:.2f}x"] if peak >= model_bytes else []
    if setting in TRAINING and anchor and peak > FSDP2_AIM * anchor:
        missed.append(f"FSDP2 by {peak / anchor - FSDP2_AIM:.2f}x")
    return "missed: " + ", ".join(missed) if missed else "met"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (or forwards) per setting")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT: checks that every setting runs")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS), help="only these")
    parser.add_argument("--report", type=Path, help="write the report here instead of docs/benchmarks/")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    given = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory() as workdir:
        text = run(SMOKE_MODEL if args.smoke else MODEL, args.steps, Path(workdir), args.settings)
    publish_report(text, __file__, given, args.report, None if args.smoke else "zero3_memory.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
