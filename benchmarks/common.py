"""Plumbing shared by the benchmark scripts: launching jobs, medians, tables and targets.

Every benchmark is one script that plays two roles: run without ``--worker`` it is the driver
(it launches jobs, gathers what each rank wrote and prints tables); run with ``--worker`` it is
one training process. Workers write ``rank<N>.json`` into the ``--out`` folder they are given.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "docs" / "benchmarks"
TWO_EMULATED_NODES = "localhost:2,127.0.0.1:2"


# ---------------------------------------------------------------------------------------- launching
@dataclass
class JobOutcome:
    """What a launched job left behind."""

    returncode: int
    output: str
    seconds: float
    ranks: dict[int, dict[str, Any]]

    def check(self, what: str) -> JobOutcome:
        if self.returncode != 0:
            raise RuntimeError(f"{what} failed with exit code {self.returncode}:\n{self.output[-4000:]}")
        return self


def _sibling_tool(name: str) -> str:
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def read_rank_files(out_dir: Path) -> dict[int, dict[str, Any]]:
    return {int(path.stem[4:]): json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))}


def write_rank_file(out_dir: Path, rank: int, data: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(data, default=float))


def run_bounded(command: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run ``command`` in its own process group; kill the whole group when it outlives ``timeout``."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    start = time.monotonic()
    process = subprocess.Popen(
        list(command),
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return 124, output + f"\n[killed after {timeout:.0f}s]", time.monotonic() - start
    return process.returncode, output, time.monotonic() - start


def horovodrun(
    script_args: Sequence[str],
    out_dir: Path,
    np: int = 2,
    hosts: str | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> JobOutcome:
    """``horovodrun -np N -H hosts --gloo python <script_args> --out out_dir``."""
    command = [_sibling_tool("horovodrun"), "-np", str(np), "-H", hosts or f"localhost:{np}", "--gloo"]
    command += [sys.executable, *script_args, "--out", str(out_dir)]
    # A busy machine can take longer than Horovod's default 30 s to start every worker.
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "180"), **(env or {})}
    code, output, seconds = run_bounded(command, timeout, env)
    return JobOutcome(code, output, seconds, read_rank_files(out_dir))


def torchrun(script_args: Sequence[str], out_dir: Path, nproc: int = 2, timeout: float = 300) -> JobOutcome:
    """``python -m torch.distributed.run --nproc_per_node N <script_args> --out out_dir`` (one node)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += [*script_args, "--out", str(out_dir)]
    code, output, seconds = run_bounded(command, timeout)
    return JobOutcome(code, output, seconds, read_rank_files(out_dir))


def daso_settings(compression: str, warmup_epochs: int, cooldown_epochs: int) -> dict[str, Any]:
    """DASO knobs for a benchmark row whose compression column also picks the cross-node wire type.

    ``"fp16"`` sends the parameters as float16, ``"none"`` as float32, so a row's bytes follow its label.
    """
    downcast = "fp16" if compression == "fp16" else "fp32"
    return {"warmup_epochs": warmup_epochs, "cooldown_epochs": cooldown_epochs, "downcast": downcast}


# ---------------------------------------------------------------------------------------- numbers
def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def steps_per_second(step_end_times: Sequence[float], warmup_steps: int) -> float:
    """Rate over the steps after the first ``warmup_steps`` (startup and first steps excluded)."""
    if len(step_end_times) < warmup_steps + 2:
        raise ValueError(f"need more than {warmup_steps + 1} timed steps, got {len(step_end_times)}")
    timed = step_end_times[warmup_steps:]
    return (len(timed) - 1) / (timed[-1] - timed[0])


def target_verdict(measured: float, target: float, higher_is_better: bool = True) -> str:
    met = measured >= target if higher_is_better else measured <= target
    return "met" if met else "not met"


# ---------------------------------------------------------------------------------------- tables
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns, readable in a terminal and in a .txt file."""
    cells = [[str(h) for h in headers]] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def save_report(name: str, text: str) -> Path:
    """Write a benchmark's printed report to docs/benchmarks/<name>.txt."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.txt"
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


# ---------------------------------------------------------------------------------------- models and data
def mlp(in_features: int, hidden: Sequence[int], classes: int) -> nn.Sequential:
    """A plain ReLU MLP: parameter count grows with ``hidden``, so communication can be made to matter."""
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def random_classification(samples: int, features: int, classes: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Synthetic inputs and labels, identical on every worker (same seed)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(inputs, labels)


def one_thread_per_worker() -> None:
    """Workers share few cores; one intra-op thread each keeps them from fighting over them."""
    torch.set_num_threads(1)
