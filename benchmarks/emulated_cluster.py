"""Time to a target training loss on an emulated two-node cluster with a slow link between nodes.

Two nodes of two workers, each node in its own network namespace; the cross-node link is shaped
to 200 Mbit/s (``tc ... tbf``) while workers inside a node talk over unshaped loopback. Horovod is
launched across the namespaces without ssh (``horovod.runner.gloo_run.launch_gloo`` with an
``exec_command`` that enters the node's namespace). For each sync mode and compression the same
MLP is trained from the same seed for a fixed number of epochs; the script reports the wall time
until the training loss (rank 0, mean of the last steps) first reaches the target, the final
validation accuracy, and ratios against flat allreduce; it also plots loss against wall time.

    sudo python benchmarks/emulated_cluster.py           # full run: table + docs/benchmarks/emulated_cluster.{txt,png}
    sudo python benchmarks/emulated_cluster.py --smoke   # tiny: checks that the cluster and every mode work

Needs root (namespaces, veth, bridge, tc); skips with a message where they cannot be made.
Every run is bounded in time, and the namespaces, bridge and links are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from netns_cluster import ClusterUnavailable, NamespaceCluster  # noqa: E402

MODES = (("allreduce", "none"), ("allreduce", "fp16"), ("hierarchical", "none"), ("hierarchical", "fp16"),
         ("daso", "none"), ("daso", "fp16"))  # fmt: skip
TARGET_SPEEDUP = 1.5
BASELINE_MARGIN = 1.10
ACCURACY_TOLERANCE_POINTS = 1.0
SKIP_EXIT_CODE = 77


@dataclass(frozen=True)
class Setup:
    features: int
    hidden: tuple[int, ...]
    classes: int
    train_samples: int
    val_samples: int
    batch_size: int
    epochs: int
    lr: float
    target_loss: float
    """Absolute target; 0 means: BASELINE_MARGIN x the loss flat allreduce ends with (see ``resolve_target``)."""
    loss_window: int
    run_timeout_s: float

    def as_args(self) -> list[str]:
        return ["--setup", ",".join(f"{k}={v}" for k, v in asdict(self).items() if k != "hidden"),
                "--hidden", ",".join(map(str, self.hidden))]  # fmt: skip


FULL = Setup(features=256, hidden=(1024, 512), classes=10, train_samples=4096, val_samples=2048, batch_size=64,
             epochs=4, lr=0.02, target_loss=0.0, loss_window=8, run_timeout_s=300)  # fmt: skip
SMOKE = Setup(features=16, hidden=(32,), classes=3, train_samples=256, val_samples=64, batch_size=16,
              epochs=2, lr=0.05, target_loss=10.0, loss_window=2, run_timeout_s=120)  # fmt: skip


def parse_setup(text: str, hidden: str) -> Setup:
    values: dict[str, Any] = {}
    for item in text.split(","):
        key, value = item.split("=")
        kind = Setup.__dataclass_fields__[key].type
        values[key] = float(value) if kind == "float" else int(value)
    return Setup(hidden=tuple(int(h) for h in hidden.split(",")), **values)


# ------------------------------------------------------------------------------------------ worker
def _data(setup: Setup) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """A learnable synthetic task with balanced classes (scikit-learn's make_classification, fixed seed)."""
    from sklearn.datasets import make_classification

    inputs, labels = make_classification(
        n_samples=setup.train_samples + setup.val_samples,
        n_features=setup.features,
        n_informative=min(32, setup.features),
        n_redundant=0,
        n_classes=setup.classes,
        n_clusters_per_class=2,
        class_sep=1.5,
        random_state=1234,
    )
    inputs_t = torch.tensor(inputs, dtype=torch.float32)
    labels_t = torch.tensor(labels, dtype=torch.int64)
    cut = setup.train_samples
    return (
        torch.utils.data.TensorDataset(inputs_t[:cut], labels_t[:cut]),
        torch.utils.data.TensorDataset(inputs_t[cut:], labels_t[cut:]),
    )


def worker_main(args: argparse.Namespace) -> None:

    from hvd_plugins import HorovodStrategy

    common.one_thread_per_worker()
    setup = parse_setup(args.setup, args.hidden)
    train, val = _data(setup)

    daso = common.daso_settings(args.compression, warmup_epochs=1, cooldown_epochs=1) if args.sync == "daso" else None
    strategy = HorovodStrategy(sync=args.sync, compression=args.compression, daso=daso)
    clock = common.StepClock(losses=True)
    trainer = common.cpu_trainer(strategy, [clock], max_epochs=setup.epochs)
    module = common.Classifier(setup.features, setup.hidden, setup.classes, lr=setup.lr, momentum=0.9)
    trainer.fit(module, torch.utils.data.DataLoader(train, batch_size=setup.batch_size, shuffle=True))
    module.eval()
    with torch.no_grad():
        inputs, labels = val.tensors
        accuracy = float((module.net(inputs).argmax(dim=1) == labels).float().mean())
    common.write_rank_file(
        args.out,
        trainer.global_rank,
        {
            "points": list(zip(clock.times, clock.losses, strict=True)),
            "train_seconds": clock.total,
            "val_accuracy": accuracy,
            "params": sum(p.numel() for p in module.parameters()),
        },
    )


# ------------------------------------------------------------------------------------------ launching
def launch_on_cluster(cluster: NamespaceCluster, worker_args: list[str], out: Path, timeout: float) -> None:
    """Launch 4 workers (2 per node) across the namespaces with Horovod's Gloo launcher, no ssh."""
    from horovod.runner.common.util.settings import Settings
    from horovod.runner.gloo_run import launch_gloo

    venv_bin = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "VIRTUAL_ENV": os.environ.get("VIRTUAL_ENV", str(Path(venv_bin).parent)),
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "120",  # process-set rendezvous waits for the slowest worker
    }
    hosts = ",".join(f"{cluster.host_name(n)}:2" for n in range(cluster.nodes))
    settings = Settings(hosts=hosts, num_proc=2 * cluster.nodes, verbose=0)
    deadline = time.monotonic() + timeout
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def exec_command(command: str, slot_info: Any, events: list[threading.Event]) -> tuple[int, float]:
        node = int(slot_info.hostname.removeprefix("node"))
        wrapped = cluster.worker_command(node, f"cd {shlex.quote(str(common.REPO))} && {command}")
        with open(logs / f"rank{slot_info.rank}.log", "w") as log:
            process = subprocess.Popen(wrapped, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            while process.poll() is None:
                if time.monotonic() > deadline or any(event.is_set() for event in events):
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    return 124, time.time()
                time.sleep(0.2)
        return process.returncode, time.time()

    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *worker_args, "--out", str(out)]
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        launch_gloo(command, exec_command, settings, nics={"eth0"}, env=env, server_ip=cluster.bridge_ip)
    except RuntimeError as error:
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.log")))
        raise RuntimeError(f"{error}\n{tails}") from None
    finally:
        for signum, handler in previous.items():  # launch_gloo replaces them with its own
            signal.signal(signum, handler)


# ------------------------------------------------------------------------------------------ reading results
def time_to_target(points: list[tuple[float, float]], target: float, window: int) -> float | None:
    """First wall time at which the mean of the last ``window`` step losses is at or below ``target``."""
    for index in range(window - 1, len(points)):
        recent = [loss for _, loss in points[index - window + 1 : index + 1]]
        if sum(recent) / window <= target:
            return points[index][0]
    return None


def smoothed(points: list[tuple[float, float]], window: int) -> list[float]:
    losses = [loss for _, loss in points]
    return [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
            for i in range(len(losses))]  # fmt: skip


def resolve_target(setup: Setup, baseline_points: list[tuple[float, float]]) -> float:
    """The target loss: as configured, or within BASELINE_MARGIN of where flat allreduce ends.

    Deriving it from the baseline avoids a magic number tuned to one machine's load: the question
    is then "how soon does each mode reach (nearly) the loss that flat allreduce ends with".
    """
    if setup.target_loss > 0:
        return setup.target_loss
    return BASELINE_MARGIN * smoothed(baseline_points, setup.loss_window)[-1]


def run_modes(setup: Setup, modes: list[tuple[str, str]], workdir: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    with NamespaceCluster() as cluster:
        cluster.check_reachable(sys.executable)
        print(f"cluster: 2 namespaces on {cluster.subnet}, cross-node link '{cluster.shaping}'", flush=True)
        for sync, compression in modes:
            key = f"{sync}/{compression}"
            out = workdir / key.replace("/", "_")
            args = [*setup.as_args(), f"--sync={sync}", f"--compression={compression}"]
            started = time.monotonic()
            try:
                launch_on_cluster(cluster, args, out, timeout=setup.run_timeout_s)
            except RuntimeError as error:  # one failed mode must not hide the others' numbers
                print(f"  {key:<20} FAILED: {str(error)[:2000]}", flush=True)
                continue
            ranks = common.read_rank_files(out)
            if 0 not in ranks:
                print(f"  {key:<20} FAILED: rank 0 wrote no result", flush=True)
                continue
            results[key] = ranks[0] | {"ranks": len(ranks), "job_seconds": time.monotonic() - started}
            print(f"  {key:<20} trained in {ranks[0]['train_seconds']:.1f}s, "
                  f"val accuracy {ranks[0]['val_accuracy']:.3f}", flush=True)  # fmt: skip
    return results


def report(setup: Setup, results: dict[str, dict[str, Any]]) -> str:
    base = results.get("allreduce/none")
    if base is None:
        raise ValueError(f"the allreduce/none baseline is missing; ran {sorted(results)}")
    target = resolve_target(setup, base["points"])
    base_time = time_to_target(base["points"], target, setup.loss_window)
    rows = []
    for sync, compression in MODES:
        key = f"{sync}/{compression}"
        if key not in results:
            rows.append([sync, compression, "failed (see log above)", "", "", "", "", ""])
            continue
        result = results[key]
        reached = time_to_target(result["points"], target, setup.loss_window)
        step_rate = len(result["points"]) / result["train_seconds"]
        speedup = base_time / reached if (reached and base_time) else None
        accuracy_gap = 100 * (result["val_accuracy"] - base["val_accuracy"])
        verdict = "(baseline)" if key == "allreduce/none" else _verdict(speedup, accuracy_gap)
        rows.append([
            sync, compression, f"{reached:.1f}" if reached else "not reached", f"{step_rate:.2f}",
            f"{100 * result['val_accuracy']:.2f}", f"{speedup:.2f}x" if speedup else "-",
            f"{accuracy_gap:+.2f}", verdict,
        ])  # fmt: skip
    params = next(iter(results.values()))["params"] if results else 0
    header = (
        f"emulated_cluster: 2 nodes x 2 workers (network namespaces), cross-node link shaped to 200 Mbit/s (tbf), "
        f"node-local unshaped; MLP {setup.features}-{'-'.join(map(str, setup.hidden))}-{setup.classes} "
        f"({params:,} parameters); batch {setup.batch_size} per worker; {setup.epochs} epochs; target training loss "
        f"{target:.4f} (rank 0, mean of last {setup.loss_window} steps"
        + ("" if setup.target_loss > 0 else f"; {BASELINE_MARGIN} x the final loss of allreduce/none")
        + ")\n"
        + f"targets: >= {TARGET_SPEEDUP}x faster to the target loss than allreduce/none, validation accuracy within "
        f"{ACCURACY_TOLERANCE_POINTS} point"
    )
    table = common.format_table(
        ["sync", "compression", "s to target", "steps/s", "val acc %", "speedup", "acc diff (pts)", "verdict"], rows
    )
    return f"{header}\n\n{table}"


def _verdict(speedup: float | None, accuracy_gap: float) -> str:
    fast = speedup is not None and speedup >= TARGET_SPEEDUP
    accurate = accuracy_gap >= -ACCURACY_TOLERANCE_POINTS
    return "met" if fast and accurate else "not met"


def plot(setup: Setup, results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for key, result in results.items():
        times = [t for t, _ in result["points"]]
        axes.plot(times, smoothed(result["points"], setup.loss_window), label=key)
    target = resolve_target(setup, results["allreduce/none"]["points"])
    axes.axhline(target, color="gray", linestyle="--", label=f"target {target:.3f}")
    axes.set_xlabel("wall time since training start (s)")
    axes.set_ylabel(f"training loss (rank 0, mean of last {setup.loss_window} steps)")
    axes.set_title("2 nodes x 2 workers, 200 Mbit/s between nodes")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 epochs: checks that everything runs")
    parser.add_argument("--modes", help="comma-separated sync/compression pairs to run (default: all)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--sync", help=argparse.SUPPRESS)
    parser.add_argument("--compression", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    setup = SMOKE if args.smoke else FULL
    modes = list(MODES)
    if args.modes:
        wanted = {tuple(mode.split("/")) for mode in args.modes.split(",")} | {("allreduce", "none")}
        unknown = wanted - set(MODES)
        if unknown:
            raise ValueError(f"--modes {sorted(unknown)} not known; choose from {[f'{s}/{c}' for s, c in MODES]}")
        modes = [mode for mode in modes if mode in wanted]
    elif args.smoke:  # one flat baseline and one compressed run per node-aware mode
        modes = [(sync, compression) for sync, compression in modes if (sync == "allreduce") == (compression == "none")]
    with tempfile.TemporaryDirectory(prefix="hvd_emulated_") as tmp:
        try:
            results = run_modes(setup, modes, Path(tmp))
        except ClusterUnavailable as reason:
            print(f"SKIPPED: the emulated cluster cannot be built here: {reason}")
            sys.exit(SKIP_EXIT_CODE)
    text = report(setup, results)
    print(text)
    if not args.smoke and not args.modes:
        print(f"saved to {common.save_report('emulated_cluster', text)}")
    if not args.smoke:
        png = (
            common.RESULTS_DIR / "emulated_cluster.png"
            if not args.modes
            else Path(tempfile.gettempdir()) / "emulated_cluster_partial.png"
        )
        plot(setup, results, png)
        print(f"plot written to {png}")


if __name__ == "__main__":
    main()
