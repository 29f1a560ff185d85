"""One Trainer script, run as users run it: ``python ray_fit.py`` on a Ray cluster (``HorovodRayStrategy``), or
under ``horovodrun`` (``HorovodStrategy``). It writes what the driver (or rank 0) ends with to ``--out``.

``--cluster N``: start a local Ray cluster of N nodes of 2 CPUs each (``ray.cluster_utils.Cluster``) and connect.
``--kill-rank R``: the worker of rank R dies (SIGKILL) at its third step. ``--refuse-first``: before the fit, what
bad arguments raise on a 2-node cluster, before any actor starts. ``--then-fabric``: after the fit, the same
regression as a Fabric loop on the same cluster. ``--case elastic``: an elastic fit over the
cluster's nodes; once it has trained a few steps the second node leaves, then a new node joins (``--shard`` shards
it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self, kill_rank: int | None = None, progress: Path | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.kill_rank = kill_rank
        self.progress = progress  # elastic: rank 0 writes each step's world there, and the end's agreement
        self.topology: dict[str, int] = {}

    def on_train_start(self) -> None:
        import horovod.torch as hvd

        self.topology = {"size": hvd.size(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}
        self.log_dict({f"hvd_{key}": float(value) for key, value in self.topology.items()}, rank_zero_only=True)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        if self.kill_rank == self.global_rank and self.global_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        if self.progress is not None:
            import horovod.torch as hvd

            time.sleep(0.1)  # room for the driver to change the cluster mid-fit
            if hvd.rank() == 0:
                with self.progress.open("a") as steps:
                    steps.write(f"{self.global_step} {hvd.size()} {hvd.cross_size()} {time.time():.3f}\n")
        return loss

    def on_train_end(self) -> None:
        """Elastic: every worker of the last world holds the same weights."""
        if self.progress is None:
            return
        import horovod.torch as hvd

        weights = torch.cat([p.detach().reshape(-1) for p in self.net.state_dict().values()])
        spread = (hvd.allgather(weights[None]) - weights).abs().max().item()
        if hvd.rank() == 0:
            with self.progress.open("a") as steps:
                steps.write(f"end {hvd.size()} {spread}\n")

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 6, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=8)


def strategy(launch: str, kill_rank: int | None, case: str = "fit", shard: str = "none") -> pl.strategies.Strategy:
    if launch == "ray" and case == "elastic":
        return ray_strategy()(
            num_workers=4, elastic=True, min_workers=2, max_workers=4, commit_every_n_steps=2, shard=shard
        )
    if launch == "ray":
        return ray_strategy()(num_workers=4, placement="SPREAD", placement_timeout_s=30)
    from hvd_plugins import HorovodStrategy

    return HorovodStrategy()


def ray_strategy() -> type:
    """``HorovodRayStrategy`` of the Lightning package this script runs with (tests/hvd_launch.py rewrites it)."""
    if pl.__name__ == "pytorch_lightning":
        from hvd_plugins.pytorch_lightning.strategies.ray import HorovodRayStrategy as ForStandalone

        return ForStandalone
    from hvd_plugins.ray import HorovodRayStrategy

    return HorovodRayStrategy


def fabric_training(launch: str) -> dict[str, Any]:
    """The same regression as a Fabric loop: ``fabric.launch(train)`` returns rank 0's result in the driver."""
    from lightning.fabric import Fabric

    if launch == "ray":
        from hvd_plugins.fabric import HorovodRayStrategy as OnRay

        fabric = Fabric(strategy=OnRay(num_workers=4, placement="SPREAD", placement_timeout_s=30), accelerator="cpu")
    else:
        from hvd_plugins.fabric import HorovodStrategy

        fabric = Fabric(strategy=HorovodStrategy(), accelerator="cpu")
    return fabric.launch(train)


def train(fabric: Any) -> dict[str, Any]:
    import horovod.torch as hvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for x, y in fabric.setup_dataloaders(loader()):
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return {"weights": weights, "rank": fabric.global_rank, "size": hvd.size(), "cross_size": hvd.cross_size()}


def bad_arguments() -> dict[str, str]:
    """On a cluster of two nodes of 2 CPUs each."""
    HorovodRayStrategy = ray_strategy()
    said: dict[str, str] = {}
    for name, arguments in (
        ("no_workers", {"num_workers": 0}),
        ("gpu", {"num_workers": 1, "use_gpu": True}),
        ("too_many", {"num_workers": 64}),
        ("unplaceable", {"num_workers": 3, "placement": "STRICT_SPREAD", "placement_timeout_s": 2}),  # two nodes
        ("elastic_spread", {"num_workers": 2, "elastic": True, "placement": "SPREAD"}),
        ("elastic_range", {"num_workers": 8, "elastic": True, "max_workers": 4}),
        ("elastic_waits", {"num_workers": 6, "elastic": True, "elastic_timeout_s": 1}),  # 4 slots
    ):
        try:
            trainer = pl.Trainer(strategy=HorovodRayStrategy(**arguments), accelerator="cpu", max_epochs=1)
            trainer.fit(Regression(), loader())
            said[name] = "no error"
        except (ValueError, RuntimeError) as error:
            said[name] = str(error)
    return said


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--launch", choices=["ray", "horovodrun"], default="ray")
    parser.add_argument("--cluster", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--case", default="fit")
    parser.add_argument("--shard", default="none")
    parser.add_argument("--refuse-first", action="store_true")
    parser.add_argument("--then-fabric", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.cluster:
        run(args)
        return
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    try:
        nodes = [cluster.add_node(num_cpus=2) for _ in range(args.cluster)]
        ray.init(address=cluster.address)
        if args.case == "elastic":  # Ray adds nodes from the main thread only: the fit runs in another
            fit = threading.Thread(target=run, args=(args,))
            fit.start()
            change_nodes(cluster, nodes[-1], args.out / "progress", fit.is_alive)
            fit.join()
        else:
            run(args)
    finally:
        ray.shutdown()
        cluster.shutdown()


def change_nodes(cluster: Any, leaving: Any, progress: Path, fitting: Callable[[], bool]) -> None:
    """The driver's view of the cluster changes mid-fit: ``leaving`` is removed after 6 steps, a new node of 2 CPUs
    joins once the fit has gone on for 6 more steps without it (unless the fit ended before)."""

    def steps_seen() -> list[tuple[int, int]]:
        text = progress.read_text() if progress.exists() else ""
        return [(int(line.split()[0]), int(line.split()[1])) for line in text.splitlines() if line[0].isdigit()]

    def wait_for(step: int, size: int) -> None:
        while fitting() and not any(seen >= step and workers == size for seen, workers in steps_seen()):
            time.sleep(0.1)

    changes = progress.with_name("nodes")  # when the cluster changed: what the fit's recovery is timed from
    wait_for(6, 4)
    if fitting():
        changes.write_text(f"left {time.time():.3f}\n")
        cluster.remove_node(leaving)
    wait_for(max(seen for seen, _ in steps_seen()) + 6, 2)
    if fitting():
        with changes.open("a") as said:
            said.write(f"joining {time.time():.3f}\n")
        cluster.add_node(num_cpus=2)


def run(args: argparse.Namespace) -> None:
    refused = bad_arguments() if args.refuse_first else {}
    progress = args.out / "progress" if args.case == "elastic" else None
    model = Regression(args.kill_rank, progress)
    trainer = pl.Trainer(
        strategy=strategy(args.launch, args.kill_rank, args.case, args.shard),
        accelerator="cpu",
        max_epochs=5 if progress is not None else 2,
        logger=False,
        default_root_dir=str(args.out),
        enable_progress_bar=False,
    )
    started = time.monotonic()
    try:
        trainer.fit(model, loader(), loader())
    except RuntimeError as error:
        ended = {"error": str(error), "seconds": time.monotonic() - started, "refused": refused}
        (args.out / "result.json").write_text(json.dumps(ended))
        return
    if trainer.global_rank != 0:
        return
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    callback = trainer.checkpoint_callback
    (args.out / "result.json").write_text(
        json.dumps(
            {
                "weights": weights,
                "metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
                "best_model_path": getattr(callback, "best_model_path", ""),
                "state": str(trainer.state.status),
                "seconds": time.monotonic() - started,
                "progress": progress.read_text() if progress is not None else "",
                "nodes": progress.with_name("nodes").read_text() if progress is not None else "",
                "fabric": fabric_training(args.launch) if args.then_fabric else {},
            }
        )
    )


if __name__ == "__main__":
    main()
    sys.stdout.flush()
