"""Steps per second: hand-written Horovod loop vs HorovodStrategy vs Lightning's DDP on Gloo.

Same MLP, same synthetic data, same batch size, 2 workers on CPU, one thread each. Each repeat
launches the three variants one after the other (order rotated between repeats, so drift in the
machine's load hits all three alike); the first steps of every run are excluded from the timing.

    python benchmarks/overhead.py            # full run, writes docs/benchmarks/overhead.txt
    python benchmarks/overhead.py --smoke    # tiny and fast: checks that everything runs

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
import pstats
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VARIANTS = ("horovod_loop", "horovod_strategy", "lightning_ddp")
TARGET_VS_FLOOR = 0.95
TARGET_VS_DDP = 1.0


@dataclass(frozen=True)
class Setup:
    """Model and run length; the same for all three variants."""

    features: int
    hidden: tuple[int, ...]
    classes: int
    batch_size: int
    steps: int
    warmup_steps: int
    repeats: int

    def as_args(self) -> list[str]:
        return [
            f"--features={self.features}",
            f"--hidden={','.join(map(str, self.hidden))}",
            f"--classes={self.classes}",
            f"--batch-size={self.batch_size}",
            f"--steps={self.steps}",
            f"--warmup-steps={self.warmup_steps}",
        ]


FULL = Setup(features=1024, hidden=(2048, 2048), classes=10, batch_size=32, steps=70, warmup_steps=10, repeats=5)
SMOKE = Setup(features=64, hidden=(128,), classes=4, batch_size=16, steps=12, warmup_steps=3, repeats=1)


# ------------------------------------------------------------------------------------------ workers
LR, MOMENTUM = 0.01, 0.9


def _dataset(setup: Setup, world: int) -> torch.utils.data.TensorDataset:
    return common.random_classification(setup.batch_size * setup.steps * world, setup.features, setup.classes)


def run_horovod_loop(setup: Setup, out: Path) -> None:
    """The floor: what a user would write by hand with Horovod and no framework."""
    import horovod.torch as hvd

    hvd.init()
    dataset = _dataset(setup, hvd.size())
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(dataset, batch_size=setup.batch_size, sampler=sampler)
    model = common.mlp(setup.features, setup.hidden, setup.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    step_ends: list[float] = []  # absolute clock; only differences are used
    for inputs, labels in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()  # waits for the gradient allreduces started by the backward hooks
        step_ends.append(time.perf_counter())
    common.write_rank_file(out, hvd.rank(), {"step_ends": step_ends})


def _fit(setup: Setup, strategy: Any, devices: int, world: int, profile_to: Path | None) -> tuple[list[float], int]:
    clock = common.StepClock()
    trainer = common.cpu_trainer(strategy, [clock], devices=devices)
    module = common.Classifier(setup.features, setup.hidden, setup.classes, lr=LR, momentum=MOMENTUM)
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


def run_horovod_strategy(setup: Setup, out: Path, profile: bool) -> None:
    import horovod.torch as hvd

    from hvd_plugins import HorovodStrategy

    strategy = HorovodStrategy()
    strategy.set_world_ranks()  # starts Horovod, so the world size is known for the dataset
    step_ends, rank = _fit(setup, strategy, 1, hvd.size(), out / "profile_strategy.txt" if profile else None)
    common.write_rank_file(out, rank, {"step_ends": step_ends})


def run_lightning_ddp(setup: Setup, out: Path, profile: bool) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(process_group_backend="gloo")
    step_ends, rank = _fit(setup, strategy, 2, 2, out / "profile_ddp.txt" if profile else None)
    common.write_rank_file(out, rank, {"step_ends": step_ends})
    # Left to interpreter exit, torch's Gloo process group can abort the worker ("terminate called
    # without an active exception", SIGABRT) after the run finished; end it explicitly.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def worker_main(args: argparse.Namespace) -> None:
    common.one_thread_per_worker()
    setup = Setup(
        features=args.features,
        hidden=tuple(int(h) for h in args.hidden.split(",")),
        classes=args.classes,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        repeats=1,
    )
    if args.worker == "horovod_loop":
        run_horovod_loop(setup, args.out)
    elif args.worker == "horovod_strategy":
        run_horovod_strategy(setup, args.out, args.profile)
    else:
        run_lightning_ddp(setup, args.out, args.profile)


# ------------------------------------------------------------------------------------------ driver
def launch(variant: str, setup: Setup, out: Path, profile: bool = False, timeout: float = 300) -> float:
    """Run one variant once; return rank 0's steps per second after warmup."""
    script = [str(Path(__file__).resolve()), f"--worker={variant}", *setup.as_args()]
    if profile:
        script.append("--profile")
    if variant == "lightning_ddp":
        outcome = common.torchrun(script, out, nproc=2, timeout=timeout)
    else:
        outcome = common.horovodrun(script, out, np=2, timeout=timeout)
    outcome.check(f"{variant} run")
    if 0 not in outcome.results:
        raise RuntimeError(f"{variant} run wrote no result for rank 0:\n{outcome.output[-3000:]}")
    return common.steps_per_second(outcome.results[0]["step_ends"], setup.warmup_steps)


def measure(setup: Setup, workdir: Path) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for repeat in range(setup.repeats):
        order = VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3]
        for variant in order:
            rate = launch(variant, setup, workdir / f"r{repeat}_{variant}")
            rates[variant].append(rate)
            print(f"  repeat {repeat + 1}/{setup.repeats}  {variant:<17} {rate:6.2f} steps/s", flush=True)
    return rates


def report(setup: Setup, rates: dict[str, list[float]]) -> str:
    params = common.parameter_count(common.mlp(setup.features, setup.hidden, setup.classes))
    med = {variant: common.median(values) for variant, values in rates.items()}
    rows = [
        [variant, common.median(values), min(values), max(values), len(values)] for variant, values in rates.items()
    ]
    per_repeat_floor = [b / a for a, b in zip(rates["horovod_loop"], rates["horovod_strategy"], strict=True)]
    per_repeat_ddp = [b / c for b, c in zip(rates["horovod_strategy"], rates["lightning_ddp"], strict=True)]
    vs_floor = common.median(per_repeat_floor)
    vs_ddp = common.median(per_repeat_ddp)
    ratio_rows = [
        [
            "b/a strategy vs hand-written Horovod",
            vs_floor,
            f">= {TARGET_VS_FLOOR}",
            common.target_verdict(vs_floor, TARGET_VS_FLOOR),
        ],
        [
            "b/c strategy vs Lightning DDP (Gloo)",
            vs_ddp,
            f">= {TARGET_VS_DDP}",
            common.target_verdict(vs_ddp, TARGET_VS_DDP),
        ],
    ]
    lines = [
        f"overhead: 2 workers on CPU, 1 thread each; MLP {setup.features}-{'-'.join(map(str, setup.hidden))}-"
        f"{setup.classes} ({params:,} parameters, {params * 4 / 2**20:.1f} MiB of fp32 gradients per step); "
        f"batch {setup.batch_size} per worker; {setup.steps} steps per run, first {setup.warmup_steps} not timed; "
        f"{setup.repeats} repeats",
        "",
        common.format_table(["variant", "median steps/s", "min", "max", "runs"], rows),
        "",
        common.format_table(["ratio (median of per-repeat ratios)", "measured", "target", "verdict"], ratio_rows),
        "",
        "median rates: " + "  ".join(f"{v}={med[v]:.2f}" for v in VARIANTS) + " steps/s",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, one short repeat")
    parser.add_argument("--repeats", type=int, default=None, help="override the number of repeats")
    parser.add_argument("--profile", action="store_true", help="also profile rank 0 of (b) and (c) once")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    for name, kind in (("features", int), ("hidden", str), ("classes", int), ("batch-size", int)):
        parser.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    setup = SMOKE if args.smoke else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            raise ValueError(f"--repeats={args.repeats} must be >= 1")
        setup = Setup(**{**asdict(setup), "repeats": args.repeats})
    with tempfile.TemporaryDirectory(prefix="hvd_overhead_") as tmp:
        rates = measure(setup, Path(tmp))
        text = report(setup, rates)
        print(text)
        if not args.smoke:
            print(f"saved to {common.save_report('overhead', text)}")
        if args.profile:
            for variant in ("horovod_strategy", "lightning_ddp"):
                launch(variant, setup, Path(tmp) / f"profile_{variant}", profile=True)
            for path in sorted(Path(tmp).glob("profile_*/profile_*.txt")):
                print(f"\n=== {path.name} (rank 0, sorted by own time) ===\n{path.read_text()}")


if __name__ == "__main__":
    main()
