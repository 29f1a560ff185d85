"""bf16-true against bf16-mixed and 32-true on the digits example: accuracy, step time, bytes sent.

Each job is ``horovodrun -np N --gloo`` on this machine, one thread per worker, training
``examples/digits.py``'s DigitsClassifier on DigitsData (the same seed, batch and epochs) with one
precision. A callback records every training step's wall time on rank 0 (steps of the first epoch
are left out) and the strategy's ``comm_counters`` give the bytes each worker handed Horovod. Each
setting runs ``--repeats`` jobs, the settings taking turns; the table gives the medians. Needs a
Horovod that takes bfloat16 (``hvd-build-horovod``) for ``bf16-true`` and the bf16 wire.

    python benchmarks/precisions.py            # writes docs/benchmarks/precisions.txt
    python benchmarks/precisions.py --smoke    # 1 epoch, one job each; no report
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing import benchmarking as bench
from hvd_plugins.testing.launch import write_rank_file
from hvd_plugins.testing.reports import publish_report

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SETTINGS = {
    "32-true": ("32-true", "none"),
    "bf16-mixed": ("bf16-mixed", "none"),
    "bf16-mixed, bf16 wire": ("bf16-mixed", "bf16"),
    "bf16-true": ("bf16-true", "none"),
}
"""Row label: (Trainer precision, HorovodStrategy compression)."""


# ------------------------------------------------------------------------------------------ worker
def worker_main(precision: str, compression: str, epochs: int, out: Path) -> None:
    import horovod.torch as hvd
    from lightning.pytorch import Callback, Trainer, seed_everything

    spec = importlib.util.spec_from_file_location("digits", EXAMPLES / "digits.py")
    assert spec is not None and spec.loader is not None
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)  # defines the model and data; trains only under __main__

    from hvd_plugins.pytorch import HorovodStrategy

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._started = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.current_epoch > 0:
                self.seconds.append(time.perf_counter() - self._started)

    bench.one_thread_per_worker()
    seed_everything(0, workers=True)
    steps = StepTimes()
    model = digits.DigitsClassifier()
    trainer = Trainer(
        strategy=HorovodStrategy(compression=compression),
        accelerator="cpu",
        precision=precision,  # type: ignore[arg-type]
        max_epochs=epochs,
        callbacks=[steps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, digits.DigitsData(32, 0))
    counters = trainer.strategy.comm_counters  # type: ignore[attr-defined]
    result = {
        "accuracy": float(trainer.callback_metrics["val_acc"]),
        "step_ms": 1e3 * statistics.median(steps.seconds) if steps.seconds else float("nan"),
        "bytes_per_step": (counters.node_local_bytes + counters.cross_node_bytes) / max(trainer.global_step, 1),
        "weights": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    write_rank_file(out, hvd.rank(), result)


# ------------------------------------------------------------------------------------------ driver
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="1 epoch, one job per setting; no report")
    parser.add_argument("--workers", type=int, default=2, help="workers per job (default 2)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per job (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per setting (default 3)")
    parser.add_argument("--report", type=Path, help="write the table here instead of docs/benchmarks/")
    parser.add_argument("--worker", nargs=2, metavar=("PRECISION", "COMPRESSION"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    epochs, repeats = (2, 1) if args.smoke else (args.epochs, args.repeats)
    if args.worker:
        worker_main(*args.worker, epochs, args.out)
        return 0
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="precisions_") as workdir:
        for repeat in range(repeats):
            for label, (precision, compression) in SETTINGS.items():
                out = Path(workdir) / f"{precision}_{compression}_{repeat}"
                script = [str(Path(__file__).resolve()), "--worker", precision, compression]
                script += ["--epochs", str(epochs)] + (["--smoke"] if args.smoke else [])
                job = bench.horovodrun(script, out, np=args.workers, timeout=600)
                runs[label].append(job.check(f"precisions, {label}").results[0])
                print(f"  {label}: {runs[label][-1]}", flush=True)
    rows = [
        [
            label,
            found[0]["weights"],
            f"{statistics.median(r['accuracy'] for r in found):.4f}",
            " / ".join(f"{r['accuracy']:.4f}" for r in found),
            f"{statistics.median(r['step_ms'] for r in found):.2f}",
            f"{statistics.median(r['bytes_per_step'] for r in found) / 1024:.1f}",
        ]
        for label, found in runs.items()
    ]
    header = (
        f"precisions: examples/digits.py's DigitsClassifier (Adam, lr 2e-3) on DigitsData, {args.workers} workers "
        f"(horovodrun --gloo, one thread each), batch 32 per worker, {epochs} epochs, seed 0; medians of {repeats} "
        "job(s). accuracy: validation accuracy over every worker's share; step ms: rank 0's median training step "
        "after the first epoch; KiB/step: bytes each worker handed Horovod per optimizer step."
    )
    table = format_table(["setting", "weights", "val acc", "each job", "step ms", "KiB/step"], rows)
    publish_report(f"{header}\n\n{table}", __file__, argv, args.report, None if args.smoke else "precisions.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
