"""Does ``torch.compile`` pay under HorovodStrategy, and does cutting its graph at gradient buckets matter?

Two workers on two emulated nodes of one worker each (``-H localhost:1,127.0.0.1:1``, unshaped), one
thread each. For each model and each setting (flat fp32, flat fp16, ZeRO-2) three variants train the
same steps on the same data: ``eager``; ``compiled`` (``trainer.fit(torch.compile(model))``, Inductor,
the graph cut where a gradient bucket fills: the strategy's default); ``compiled_whole`` (the same with
``torch._dynamo.config.optimize_ddp = False``: one graph, every gradient ready at the end of backward).
All variants of a model share one job (order rotated between repeats); the first steps of each fit,
which hold the compilation, are left out of the step time and reported as the compile cost.

    python benchmarks/compiled.py            # the Transformer and the digits MLP, medians of 3: docs report
    python benchmarks/compiled.py --smoke    # tiny and fast: checks that everything runs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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

HOSTS = "localhost:1,127.0.0.1:1"
"""Two emulated nodes of one worker each (2x1), unshaped."""
SETTINGS: dict[str, dict[str, Any]] = {"flat": {}, "fp16": {"compression": "fp16"}, "zero2": {"shard": "gradients"}}
VARIANTS = ("eager", "compiled", "compiled_whole")
DIGITS = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


@dataclass(frozen=True)
class Setup:
    model: str
    """``transformer`` (the benchmarks' TransformerLM) or ``digits`` (examples/digits.py's classifier and data)."""
    size: tuple[tuple[str, Any], ...]
    batch_size: int
    steps: int
    warmup_steps: int
    """Steps left out of the step time: the compilation happens in the first."""


FULL = {
    "transformer": Setup("transformer", (("vocab", 2048), ("d_model", 112), ("layers", 16), ("heads", 4),
                         ("context", 64)), batch_size=16, steps=30, warmup_steps=5),
    "digits": Setup("digits", (), batch_size=32, steps=40, warmup_steps=5),
}  # fmt: skip
SMOKE = {
    "transformer": Setup("transformer", (("vocab", 128), ("d_model", 32), ("layers", 2), ("heads", 2),
                         ("context", 16)), batch_size=4, steps=6, warmup_steps=2),
}  # fmt: skip


# ------------------------------------------------------------------------------------------ worker
def _module_and_data(setup: Setup, world: int) -> tuple[Any, torch.utils.data.DataLoader]:
    if setup.model == "digits":
        spec = importlib.util.spec_from_file_location("digits", DIGITS)  # the demo's classifier and data
        assert spec is not None and spec.loader is not None
        digits = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(digits)
        data = digits.DigitsData(setup.batch_size)
        return digits.DigitsClassifier(), torch.utils.data.DataLoader(data.train_set, batch_size=setup.batch_size)
    sizes = dict(setup.size)
    dataset = bench.synthetic_data("transformer", setup.batch_size * setup.steps * world, **sizes)
    return bench.build_module("transformer", **sizes), torch.utils.data.DataLoader(dataset, setup.batch_size)


def fit_once(setup: Setup, setting: str, variant: str) -> dict[str, float]:
    """One fit of ``setup``'s model; its median step time (warm steps) and the time its first steps took."""
    import horovod.torch as hvd
    from torch._dynamo import config as dynamo_config

    from hvd_plugins import HorovodStrategy

    torch._dynamo.reset()
    dynamo_config.optimize_ddp = variant != "compiled_whole"
    module, loader = _module_and_data(setup, hvd.size())
    clock = bench.StepClock()
    trainer = bench.cpu_trainer(HorovodStrategy(**SETTINGS[setting]), [clock], max_epochs=1000)
    trainer.fit_loop.epoch_loop.max_steps = setup.steps  # the digits' epochs are shorter than that
    if variant != "eager" and setup.model == "digits":
        module.forward = torch.compile(module.forward)  # as examples/digits.py --compile: self.log stays eager
    elif variant != "eager":
        module = torch.compile(module)
    trainer.fit(module, loader)
    times = clock.times
    warm = [b - a for a, b in zip(times[setup.warmup_steps - 1 : -1], times[setup.warmup_steps :], strict=True)]
    return {"ms_per_step": 1000 * bench.median(warm), "first_steps_s": times[setup.warmup_steps - 1]}


def worker_main(setup: Setup, order: Sequence[str], out: Path) -> None:
    import horovod.torch as hvd

    bench.one_thread_per_worker()
    hvd.init()
    results: dict[str, dict[str, float]] = {}
    for name in order:
        setting, variant = name.split("/")
        start = time.perf_counter()
        results[name] = fit_once(setup, setting, variant)
        results[name]["fit_s"] = time.perf_counter() - start
    write_rank_file(out, hvd.rank(), results)


# ------------------------------------------------------------------------------------------ driver
def run_model(setup: Setup, repeats: int, workdir: Path, log: Any = print) -> dict[str, list[dict[str, float]]]:
    names = [f"{setting}/{variant}" for setting in SETTINGS for variant in VARIANTS]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for repeat in range(repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        out = workdir / f"{setup.model}_{repeat}"
        args = [str(Path(__file__).resolve()), "--worker", json.dumps(asdict(setup)), "--order", ",".join(order)]
        job = bench.horovodrun(args, out, np=2, hosts=HOSTS, timeout=1800)
        job.check()
        for name, result in job.results[0].items():
            runs[name].append(result)
        log(f"{setup.model}: repeat {repeat + 1}/{repeats} done")
    return runs


def report(all_runs: dict[str, dict[str, list[dict[str, float]]]], setups: dict[str, Setup]) -> str:
    rows = []
    for model, runs in all_runs.items():
        for setting in SETTINGS:
            eager = bench.median([r["ms_per_step"] for r in runs[f"{setting}/eager"]])
            for variant in VARIANTS:
                results = runs[f"{setting}/{variant}"]
                step = bench.median([r["ms_per_step"] for r in results])
                rows.append(
                    [
                        model,
                        setting,
                        variant,
                        f"{step:.1f}",
                        f"{min(r['ms_per_step'] for r in results):.1f}-{max(r['ms_per_step'] for r in results):.1f}",
                        f"{eager / step:.2f}x",
                        f"{bench.median([r['first_steps_s'] for r in results]):.1f}",
                    ]
                )
    header = ["model", "setting", "variant", "ms/step", "range", "speed vs eager", "first steps (s)"]
    lines = [
        "torch.compile under HorovodStrategy: 2 workers on 2 emulated nodes of 1 (unshaped), 1 thread each.",
        "ms/step: median over the repeats of each fit's median warm step; 'first steps': the steps left out",
        "(compilation included). compiled: Inductor, graph cut at gradient buckets (the default);",
        "compiled_whole: one graph (torch._dynamo.config.optimize_ddp = False).",
        "",
        *(f"{model}: {bench.describe(model, **dict(s.size)) if model == 'transformer' else 'examples/digits.py'}, "
          f"batch {s.batch_size} a worker, {s.steps} steps, {s.warmup_steps} left out" for model, s in setups.items()),
        "",
        format_table(header, rows),
    ]  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, one repeat: checks that it all runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="transformer,digits", help="comma-separated: transformer, digits")
    parser.add_argument("--report", type=Path, help="where to write the report (default: docs/benchmarks/)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--order", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        fields = json.loads(args.worker)
        setup = Setup(**{**fields, "size": tuple((k, v) for k, v in fields["size"])})
        worker_main(setup, args.order.split(","), args.out)
        return 0
    setups = SMOKE if args.smoke else {name: FULL[name] for name in args.models.split(",")}
    repeats = 1 if args.smoke else args.repeats
    workdir = Path(tempfile.mkdtemp(prefix="compiled_bench_"))
    all_runs = {name: run_model(setup, repeats, workdir) for name, setup in setups.items()}
    text = report(all_runs, setups)
    publish_report(text, __file__, argv or sys.argv[1:], args.report, None if args.smoke else "compiled.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
