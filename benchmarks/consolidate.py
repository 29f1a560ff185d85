"""How much memory making a checkpoint saved in parts whole takes: in a job's memory, and with the tool.

Writes a checkpoint in parts (``shard_checkpoint="parts"``) of a synthetic AdamW state, 4 workers, then
makes it whole two ways, each in a fresh process whose anonymous resident memory (``RssAnon``: what
the process itself allocated, not the file pages the kernel can drop) is sampled every 20 ms:

- **in memory**: the parts joined as a job of another size does on load (``read_parts_beside``: the
  parts mapped from disk, the whole state made in memory, of which each worker then keeps its slices);
- **the tool**: ``python -m hvd_plugins.consolidate`` (parts mapped from disk, each parameter's state
  joined into a file of its own beside the output).

The peak is given beyond the same process's before it started (Python, torch), and as a multiple of
the whole state. Aim: the tool never holds the optimizer state in its own memory (under 0.1x).

    python benchmarks/consolidate.py           # 512 MB of state: writes docs/benchmarks/consolidate.txt
    python benchmarks/consolidate.py --smoke   # 32 MB: checks that both ways run
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from hvd_plugins.core.sync.parts import PART_FORMAT, part_path, parts_marker, read_parts_beside
from hvd_plugins.core.tables import format_table
from hvd_plugins.testing.reports import publish_report

WORKERS = 4
PARAMETERS = 8
AIM = 0.1
"""The tool's peak beyond its start, as a multiple of the whole state."""


def write_parts(folder: Path, elements: int) -> tuple[Path, int]:
    """A checkpoint in parts: ``PARAMETERS`` parameters of ``elements`` each, AdamW's two moments and its step."""
    shard = elements // WORKERS
    for rank in range(WORKERS):
        buckets = [
            {
                "group": 0,
                "parameters": [index],
                "shapes": [[elements]],
                "numel": elements,
                "state": {
                    "step": torch.tensor(3.0),
                    "exp_avg": torch.full((shard,), float(rank)),
                    "exp_avg_sq": torch.full((shard,), 1.0),
                },
            }
            for index in range(PARAMETERS)
        ]
        part = {
            "format": PART_FORMAT,
            "rank": rank,
            "workers": WORKERS,
            "param_groups": [{"lr": 1e-3, "params": list(range(PARAMETERS))}],
            "buckets": buckets,
            "parked": {},
        }
        torch.save({"optimizer_parts": [part]}, part_path(folder / "last.ckpt", rank, WORKERS))
    torch.save({"state_dict": {}, "optimizer_states": parts_marker(WORKERS, 1)}, folder / "last.ckpt")
    return folder / "last.ckpt", 2 * PARAMETERS * elements * 4


def anonymous_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def peak_beyond_start(command: list[str]) -> tuple[float, float]:
    """Run ``command`` (which prints ``ready`` once imported, then waits for a line) and sample its anonymous
    memory: (MiB at ready, peak MiB beyond it)."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdin is not None
    assert process.stdout.readline().strip() == "ready", "the worker did not start"
    start = anonymous_kib(process.pid)
    peak = [start]

    def sample() -> None:
        while process.poll() is None:
            try:
                peak[0] = max(peak[0], anonymous_kib(process.pid))
            except OSError:
                return
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    process.stdin.write("go\n")
    process.stdin.flush()
    output = process.stdout.read()
    sampler.join()
    if process.wait() != 0:
        raise RuntimeError(f"{command} failed:\n{output}")
    return start / 1024, (peak[0] - start) / 1024


def worker(way: str, checkpoint: Path) -> None:
    """One way of making ``checkpoint`` whole, after a line on stdin (the sampler knows the start by then)."""
    if way == "tool":
        from hvd_plugins import consolidate as tool
    print("ready", flush=True)
    sys.stdin.readline()
    if way == "tool":
        tool.main([str(checkpoint), "-o", str(checkpoint.with_name("whole.ckpt"))])
    else:
        loaded = torch.load(checkpoint, weights_only=False)
        read_parts_beside(loaded, checkpoint, world_size=WORKERS + 1, rank=0)  # another size: every part, joined
        print(f"{len(loaded['optimizer_states'][0]['state'])} parameters", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="32 MB of state; writes no report")
    parser.add_argument("--report", type=Path, help="where to write the report")
    parser.add_argument("--worker", choices=["memory", "tool"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.checkpoint)
        return 0
    elements = 500_000 if args.smoke else 8_000_000
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        checkpoint, state_bytes = write_parts(Path(folder), elements)
        state_mib = state_bytes / 2**20
        for way, label in (("memory", "in memory (a job's load)"), ("tool", "python -m hvd_plugins.consolidate")):
            command = [sys.executable, str(Path(__file__).resolve()), f"--worker={way}", f"--checkpoint={checkpoint}"]
            start, peak = peak_beyond_start(command)
            verdict = f"aim < {AIM}x: {'met' if peak / state_mib < AIM else 'not met'}" if way == "tool" else ""
            rows.append([label, f"{start:.0f}", f"{peak:.0f}", f"{peak / state_mib:.2f}x", verdict])
    headers = ["way", "MiB at start", "peak MiB beyond it", "of the state", ""]
    title = (
        f"making a checkpoint in parts whole: AdamW state of {PARAMETERS} parameters x {elements:,} elements "
        f"({state_mib:.0f} MiB whole), {WORKERS} parts; anonymous resident memory (RssAnon), sampled every 20 ms"
    )
    publish_report(f"{title}\n\n{format_table(headers, rows)}", __file__, argv or sys.argv[1:], args.report,
                   None if args.smoke else "consolidate.txt")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
