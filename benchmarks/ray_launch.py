"""What running on Ray costs: ``HorovodRayStrategy`` against ``horovodrun`` on the same Trainer script.

One machine, 4 workers: ``horovodrun -np 4 -H localhost:4 --gloo`` first, then a local Ray cluster
(``ray.init(num_cpus=4)``, started and settled before the clock runs; its processes share the 2 cores). Each run
trains an MLP on random data for ``--steps`` steps; rank 0 writes when its first step started and its step times.
Printed per launch:

- **command to first step**: from starting ``python train.py`` (or ``horovodrun ... python train.py``) to rank
  0's first step: Python's and torch's imports, the workers' start, Horovod's;
- **fit to first step**: from the ``trainer.fit`` call in the script (the driver's, under Ray) to rank 0's first
  step: under Ray this holds the actors' start and their imports, under horovodrun the workers run already;
- **step time**: rank 0's median after 5 warm-up steps, and Ray's as a multiple of horovodrun's.

    python benchmarks/ray_launch.py           # writes docs/benchmarks/ray_launch.txt
    python benchmarks/ray_launch.py --smoke   # 8 steps of 2 workers: checks that both launches run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing.launch import horovodrun_command
from hvd_plugins.testing.reports import publish_report

WORKERS = 4
WARMUP = 5


def run_worker(args: argparse.Namespace) -> None:
    """The training script both launches run (``--worker ray`` or ``--worker horovodrun``)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Timed(pl.Callback):
        def __init__(self) -> None:
            self.fit_called_at = 0.0
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            self.starts.append(time.time())

        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            if trainer.global_rank == 0:
                steps = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)][WARMUP:]
                result = {"fit_called_at": self.fit_called_at, "first_step_at": self.starts[0], "steps": steps}
                Path(args.out).write_text(json.dumps(result))

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64 * args.steps * args.workers, 256, generator=generator),
        torch.randint(0, 10, (64 * args.steps * args.workers,), generator=generator),
    )
    if args.worker == "ray":
        import ray

        from hvd_plugins.ray import HorovodRayStrategy

        ray.init(address=args.address)
        strategy: Any = HorovodRayStrategy(num_workers=args.workers)
    else:
        from hvd_plugins import HorovodStrategy

        strategy = HorovodStrategy()
    timed = Timed()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timed],
    )  # fmt: skip
    timed.fit_called_at = time.time()
    trainer.fit(MLP(), DataLoader(data, batch_size=64))


def measure(launch: str, steps: int, workers: int, address: str | None, scratch: Path) -> dict[str, float]:
    """One run of ``launch``; the times rank 0 wrote, against the command's start."""
    out = scratch / f"{launch}.json"
    worker = [sys.executable, __file__, "--worker", launch, "--steps", str(steps), "--workers", str(workers)]
    worker += ["--out", str(out)]
    if launch == "ray":
        command = [*worker, "--address", str(address)]
    else:
        command = [*horovodrun_command(), "-np", str(workers), "-H", f"localhost:{workers}", "--gloo", *worker]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{launch} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    found = json.loads(out.read_text())
    return {
        "command_to_first_step": found["first_step_at"] - started,
        "fit_to_first_step": found["first_step_at"] - found["fit_called_at"],
        "step_ms": 1000 * statistics.median(found["steps"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="8 steps of 2 workers: checks that both launches run")
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument("--worker", choices=["ray", "horovodrun"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    import ray

    steps, workers = (8, 2) if args.smoke else (args.steps, args.workers)
    with tempfile.TemporaryDirectory() as scratch:
        found = {"horovodrun": measure("horovodrun", steps, workers, None, Path(scratch))}  # before Ray starts
        context = ray.init(num_cpus=workers)
        try:
            if not args.smoke:
                time.sleep(5)  # the workers Ray starts ahead of time are up
            found["ray"] = measure("ray", steps, workers, context.address_info["address"], Path(scratch))
        finally:
            ray.shutdown()
    base = found["horovodrun"]["step_ms"]
    rows = []
    for launch, times in found.items():
        first, fit, step = times["command_to_first_step"], times["fit_to_first_step"], times["step_ms"]
        rows.append([launch, f"{first:.1f}", f"{fit:.1f}", f"{step:.1f}", f"{step / base:.2f}x"])
    headers = ["launch", "command to first step s", "fit to first step s", "step ms", "step vs horovodrun"]
    text = (
        f"ray_launch: {workers} workers on one machine, an MLP of 0.27 M parameters, batch 64, {steps} steps "
        f"(step time: median after {WARMUP})\n" + format_table(headers, rows)
    )
    publish_report(
        text,
        __file__,
        argv if argv is not None else sys.argv[1:],
        args.report,
        None if args.smoke else "ray_launch.txt",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
