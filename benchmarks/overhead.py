"""Does HorovodStrategy cost steps per second against a hand-written Horovod loop, and against Lightning's DDP?

Same model, same synthetic data, same batch size, 2 workers on CPU, one thread each. Each repeat
launches the three variants one after the other (order rotated between repeats, so drift in the
machine's load hits all three alike); the first steps of every run are excluded from the timing.
The model is the benchmarks' MLP (a few large tensors), or with ``--model`` a Transformer language
model (260 tensors, tied embedding, AdamW) or a ResNet with BatchNorm (47 small tensors).

    python benchmarks/overhead.py                        # full run, writes docs/benchmarks/overhead.txt
    python benchmarks/overhead.py --model transformer    # writes docs/benchmarks/overhead_transformer.txt
    python benchmarks/overhead.py --smoke                # tiny and fast: checks that everything runs

(a) ``horovod_loop``: hvd.DistributedOptimizer + a plain torch loop, launched with horovodrun.
(b) ``horovod_strategy``: the same model in a LightningModule, ``Trainer(strategy=HorovodStrategy())``,
    launched with horovodrun.
(c) ``lightning_ddp``: ``Trainer(strategy=DDPStrategy(process_group_backend="gloo"), devices=2)``,
    launched with torch's own launcher (``python -m torch.distributed.run --nproc_per_node 2``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

VARIANTS = ("horovod_loop", "horovod_strategy", "lightning_ddp")
TARGET_VS_FLOOR = 0.95
TARGET_VS_DDP = 1.0


@dataclass(frozen=True)
class Setup:
    """Model and run length; the same for all three variants."""

    model: str
    """``mlp``, ``transformer`` or ``convnet``: ``bench.build_module(model, **dict(size))``."""
    size: tuple[tuple[str, Any], ...]
    batch_size: int
    steps: int
    warmup_steps: int
    repeats: int
    shared_job: bool = False
    """Run the two horovodrun variants in one job (the smoke: what it checks is that each runs, not their rates)."""

    @property
    def sizes(self) -> dict[str, Any]:
        return dict(self.size)

    def as_args(self) -> list[str]:
        return [
            f"--model={self.model}",
            f"--size={json.dumps(self.sizes)}",
            f"--batch-size={self.batch_size}",
            f"--steps={self.steps}",
            f"--warmup-steps={self.warmup_steps}",
        ]


MODELS = ("mlp", "transformer", "convnet")
FULL = {
    # 6.3 M parameters in 6 tensors (24 MiB of gradients).
    "mlp": Setup("mlp", (("features", 1024), ("hidden", (2048, 2048)), ("classes", 10)), batch_size=32, steps=70,
                 warmup_steps=10, repeats=5),
    # 2.7 M parameters in 260 tensors (10 MiB); 16 sequences of 64 tokens per worker and step.
    "transformer": Setup("transformer", (("vocab", 2048), ("d_model", 112), ("layers", 16), ("heads", 4),
                         ("context", 64)), batch_size=16, steps=40, warmup_steps=8, repeats=5),
    # 0.18 M parameters in 47 tensors (0.7 MiB); 32 images of 32x32 per worker and step.
    "convnet": Setup("convnet", (("channels", (16, 32, 64)), ("blocks", 2), ("classes", 10)), batch_size=32,
                     steps=70, warmup_steps=10, repeats=5),
}  # fmt: skip
SMOKE = {
    "mlp": Setup("mlp", (("features", 64), ("hidden", (128,)), ("classes", 4)), batch_size=16, steps=12,
                 warmup_steps=3, repeats=1, shared_job=True),
    "transformer": Setup("transformer", (("vocab", 256), ("d_model", 64), ("layers", 2), ("heads", 4),
                         ("context", 32)), batch_size=8, steps=12, warmup_steps=3, repeats=1, shared_job=True),
    "convnet": Setup("convnet", (("channels", (8, 16, 32)), ("blocks", 1), ("classes", 4)), batch_size=16, steps=12,
                     warmup_steps=3, repeats=1, shared_job=True),
}  # fmt: skip


# ------------------------------------------------------------------------------------------ workers
def _module(setup: Setup) -> bench.SyntheticTaskModule:
    """The model with its own optimizer settings (the MLP: SGD, lr 0.01, momentum 0.9)."""
    return bench.build_module(setup.model, **setup.sizes)


def _dataset(setup: Setup, world: int) -> torch.utils.data.TensorDataset:
    return bench.synthetic_data(setup.model, setup.batch_size * setup.steps * world, **setup.sizes)


def run_horovod_loop(setup: Setup) -> tuple[list[float], int]:
    """The floor: what a user would write by hand with Horovod and no framework."""
    import horovod.torch as hvd

    hvd.init()
    dataset = _dataset(setup, hvd.size())
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(dataset, batch_size=setup.batch_size, sampler=sampler)
    model = _module(setup)  # used as a plain torch module: its forward, loss and optimizer, no Trainer
    optimizer = hvd.DistributedOptimizer(model.configure_optimizers(), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    step_ends: list[float] = []  # absolute clock; only differences are used
    for inputs, labels in loader:
        optimizer.zero_grad()
        loss = model.loss(inputs, labels)
        loss.backward()
        optimizer.step()  # waits for the gradient allreduces started by the backward hooks
        step_ends.append(time.perf_counter())
    return step_ends, hvd.rank()


def _fit(setup: Setup, strategy: Any, devices: int, world: int, profile_to: Path | None) -> tuple[list[float], int]:
    clock = bench.StepClock()
    trainer = bench.cpu_trainer(strategy, [clock], devices=devices)
    module = _module(setup)
    loader = torch.utils.data.DataLoader(_dataset(setup, world), batch_size=setup.batch_size, shuffle=True)
    profiler = cProfile.Profile() if profile_to is not None else None
    if profiler is not None:
        profiler.enable()
    trainer.fit(module, loader)
    if profiler is not None and trainer.global_rank == 0:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        profile_to.write_text(text.getvalue())
    return clock.times, trainer.global_rank


def run_horovod_strategy(setup: Setup, out: Path, profile: bool) -> tuple[list[float], int]:
    import horovod.torch as hvd

    from hvd_plugins import HorovodStrategy

    strategy = HorovodStrategy()
    strategy.set_world_ranks()  # starts Horovod (unless the loop before it did), so the world size is known
    return _fit(setup, strategy, 1, hvd.size(), out / "profile_strategy.txt" if profile else None)


def run_lightning_ddp(setup: Setup, out: Path, profile: bool) -> tuple[list[float], int]:
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(process_group_backend="gloo")
    result = _fit(setup, strategy, 2, 2, out / "profile_ddp.txt" if profile else None)
    # Left to interpreter exit, torch's Gloo process group can abort the worker ("terminate called
    # without an active exception", SIGABRT) after the run finished; end it explicitly.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


def worker_main(args: argparse.Namespace) -> None:
    """Run each variant of ``--worker`` (comma-separated) in turn; one rank file holds every variant's steps."""
    bench.one_thread_per_worker()
    setup = Setup(
        model=args.model,
        size=tuple(json.loads(args.size).items()),
        batch_size=args.batch_size,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        repeats=1,
    )
    steps: dict[str, list[float]] = {}
    rank = 0
    for variant in args.worker.split(","):
        if variant == "horovod_loop":
            steps[variant], rank = run_horovod_loop(setup)
        elif variant == "horovod_strategy":
            steps[variant], rank = run_horovod_strategy(setup, args.out, args.profile)
        else:
            steps[variant], rank = run_lightning_ddp(setup, args.out, args.profile)
    write_rank_file(args.out, rank, {"step_ends": steps})


# ------------------------------------------------------------------------------------------ driver
def launch(
    variants: Sequence[str], setup: Setup, out: Path, profile: bool = False, timeout: float = 300
) -> dict[str, float]:
    """Run ``variants`` in one job (all under horovodrun, or ``lightning_ddp`` alone under torchrun).

    Returns rank 0's steps per second after warmup, per variant.
    """
    script = [str(Path(__file__).resolve()), f"--worker={','.join(variants)}", *setup.as_args()]
    if profile:
        script.append("--profile")
    what = f"{' + '.join(variants)} run"
    if "lightning_ddp" in variants:
        if len(variants) > 1:
            raise ValueError("lightning_ddp runs under torchrun, alone in its job")
        outcome = bench.torchrun(script, out, nproc=2, timeout=timeout)
    else:
        outcome = bench.horovodrun(script, out, np=2, timeout=timeout)
    outcome.check(what)
    if 0 not in outcome.results:
        raise RuntimeError(f"{what} wrote no result for rank 0:\n{outcome.output[-3000:]}")
    step_ends = outcome.results[0]["step_ends"]
    return {variant: bench.steps_per_second(step_ends[variant], setup.warmup_steps) for variant in variants}


def jobs_of(setup: Setup, repeat: int) -> list[tuple[str, ...]]:
    """The jobs of one repeat, in order: one per variant, rotated by the repeat; or the shared smoke jobs."""
    if setup.shared_job:
        return [("horovod_loop", "horovod_strategy"), ("lightning_ddp",)]
    order = VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3]
    return [(variant,) for variant in order]


def measure(setup: Setup, workdir: Path) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for repeat in range(setup.repeats):
        for variants in jobs_of(setup, repeat):
            for variant, rate in launch(variants, setup, workdir / f"r{repeat}_{'_'.join(variants)}").items():
                rates[variant].append(rate)
                print(f"  repeat {repeat + 1}/{setup.repeats}  {variant:<17} {rate:6.2f} steps/s", flush=True)
    return rates


def report(setup: Setup, rates: dict[str, list[float]]) -> str:
    module = _module(setup)
    params, tensors = bench.parameter_count(module), bench.tensor_count(module)
    med = {variant: bench.median(values) for variant, values in rates.items()}
    rows = [[variant, bench.median(values), min(values), max(values), len(values)] for variant, values in rates.items()]
    per_repeat_floor = [b / a for a, b in zip(rates["horovod_loop"], rates["horovod_strategy"], strict=True)]
    per_repeat_ddp = [b / c for b, c in zip(rates["horovod_strategy"], rates["lightning_ddp"], strict=True)]
    vs_floor = bench.median(per_repeat_floor)
    vs_ddp = bench.median(per_repeat_ddp)
    ratio_rows = [
        [
            "b/a strategy vs hand-written Horovod",
            vs_floor,
            f">= {TARGET_VS_FLOOR}",
            bench.target_verdict(vs_floor, TARGET_VS_FLOOR),
        ],
        [
            "b/c strategy vs Lightning DDP (Gloo)",
            vs_ddp,
            f">= {TARGET_VS_DDP}",
            bench.target_verdict(vs_ddp, TARGET_VS_DDP),
        ],
    ]
    lines = [
        f"overhead: 2 workers on CPU, 1 thread each; {bench.describe(setup.model, **setup.sizes)} ({params:,} "
        f"parameters in {tensors} tensors, {params * 4 / 2**20:.1f} MiB of fp32 gradients per step); "
        f"batch {setup.batch_size} per worker; {setup.steps} steps per run, first {setup.warmup_steps} not timed; "
        f"{setup.repeats} repeats",
        "",
        format_table(["variant", "median steps/s", "min", "max", "runs"], rows),
        "",
        format_table(["ratio (median of per-repeat ratios)", "measured", "target", "verdict"], ratio_rows),
        "",
        "median rates: " + "  ".join(f"{v}={med[v]:.2f}" for v in VARIANTS) + " steps/s",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, one short repeat; writes no report")
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="mlp",
        help="mlp (default; 6.3 M parameters in 6 tensors), transformer (a Transformer LM, 2.7 M in 260 tensors) "
        "or convnet (a ResNet with BatchNorm, 0.18 M in 47 tensors)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        help="write the table here (default: docs/benchmarks/overhead.txt, overhead_<model>.txt for another model "
        "than the MLP; none with --smoke)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="override the number of repeats")
    parser.add_argument("--profile", action="store_true", help="also profile rank 0 of (b) and (c) once")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if not set(args.worker.split(",")) <= set(VARIANTS):
            parser.error(f"--worker {args.worker!r}: comma-separated from {list(VARIANTS)}")
        worker_main(args)
        return 0
    setup = (SMOKE if args.smoke else FULL)[args.model]
    if args.repeats is not None:
        if args.repeats < 1:
            raise ValueError(f"--repeats={args.repeats} must be >= 1")
        setup = Setup(**{**asdict(setup), "repeats": args.repeats})
    with tempfile.TemporaryDirectory(prefix="hvd_overhead_") as tmp:
        rates = measure(setup, Path(tmp))
        text = report(setup, rates)
        default_report = "overhead.txt" if args.model == "mlp" else f"overhead_{args.model}.txt"
        publish_report(text, __file__, argv, args.report, None if args.smoke else default_report)
        if args.profile:
            for variant in ("horovod_strategy", "lightning_ddp"):
                launch((variant,), setup, Path(tmp) / f"profile_{variant}", profile=True)
            for path in sorted(Path(tmp).glob("profile_*/profile_*.txt")):
                print(f"\n=== {path.name} (rank 0, sorted by own time) ===\n{path.read_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
