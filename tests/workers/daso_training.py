"""DASO under horovodrun on emulated nodes: consistency after syncs, final loss, bytes on the wire.

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python tests/workers/daso_training.py --out DIR
    horovodrun -np 2 -H localhost:1,127.0.0.1:1 --gloo python tests/workers/daso_training.py --out DIR --case lean

Every rank runs the same fits in the same order and writes ``rank<N>.json``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import horovod.torch as hvd
import torch
from _common import parse_out, run_checks, write_result
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from sklearn.datasets import make_classification
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins import HorovodStrategy
from hvd_plugins.callbacks import DasoScheduleCallback
from hvd_plugins.comm.counters import CommCounters
from hvd_plugins.comm.topology import build_node_groups, discover_topology
from hvd_plugins.daso.config import DasoConfig
from hvd_plugins.daso.schedule import Phase
from hvd_plugins.daso.sync import DasoSync

BATCH_SIZE = 16
FEATURES, CLASSES = 20, 4


def noisy_classification() -> TensorDataset:
    """1024 samples, 10 % of the labels flipped: the loss floors well above zero, so losses compare."""
    x, y = make_classification(
        n_samples=1024,
        n_features=FEATURES,
        n_informative=10,
        n_classes=CLASSES,
        flip_y=0.1,
        class_sep=1.5,
        random_state=0,
    )
    return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))


class Classifier(LightningModule):
    def __init__(self, optimizer: str, batchnorm: bool) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        norm: list[nn.Module] = [nn.BatchNorm1d(64)] if batchnorm else []
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), *norm, nn.ReLU(), nn.Linear(64, CLASSES))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.1)


def model_state(model: LightningModule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat parameters, floating optimizer state and floating buffers of this worker."""
    params = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    optimizer = model.trainer.strategy.optimizers[0]
    state = [
        v.reshape(-1).float()
        for p in model.parameters()
        for _, v in sorted(optimizer.state.get(p, {}).items())
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    ]
    buffers = [b.reshape(-1).float() for b in model.buffers() if b.is_floating_point()]
    empty = torch.zeros(0)
    return params, torch.cat(state) if state else empty, torch.cat(buffers) if buffers else empty


def daso_of(strategy: Any) -> Any:
    """The strategy's DASO syncer (``daso_sync``; ``daso`` before the attribute was renamed)."""
    return getattr(strategy, "daso_sync", None) or getattr(strategy, "daso", None)


def gather_rows(flat: torch.Tensor, name: str) -> torch.Tensor:
    return hvd.allgather(flat.unsqueeze(0), name=name)


class ConsistencyProbe(Callback):
    """After every blocking sync: all workers equal. Between cross-node syncs: nodes equal inside, differ across."""

    def __init__(self) -> None:
        self.after_blocking = {"checked": 0, "params_equal": 0, "state_equal": 0, "buffers_equal": 0}
        self.between = {"checked": 0, "node_agrees": 0, "nodes_differ": 0}
        self.phases_seen: set[str] = set()
        self.daso: Any = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.daso = daso_of(trainer.strategy)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            return  # the previous epoch's end is checked in on_train_epoch_end
        plan = self.daso.schedule.last_plan
        self.phases_seen.add(self.daso.schedule.phase.value)
        if plan.blocking:
            self._check_all_equal(pl_module)
        elif self.daso.schedule.phase is Phase.CYCLING:
            self._check_nodes(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_all_equal(pl_module)

    def _check_all_equal(self, pl_module: LightningModule) -> None:
        counts = self.after_blocking
        counts["checked"] += 1
        for key, flat in zip(("params_equal", "state_equal", "buffers_equal"), model_state(pl_module), strict=True):
            rows = gather_rows(flat, f"probe.{key}")
            counts[key] += int(all(torch.equal(rows[0], row) for row in rows))

    def _check_nodes(self, trainer: Trainer, pl_module: LightningModule) -> None:
        nodes = trainer.strategy.topology.nodes
        rows = gather_rows(model_state(pl_module)[0], "probe.between")
        self.between["checked"] += 1
        self.between["node_agrees"] += int(all(torch.equal(rows[node[0]], rows[r]) for node in nodes for r in node))
        self.between["nodes_differ"] += int(not torch.equal(rows[nodes[0][0]], rows[nodes[1][0]]))


class EpochBytes(Callback):
    """Communication counters of each training epoch (the last batch's sync included)."""

    def __init__(self) -> None:
        self.per_epoch: list[dict[str, float]] = []
        self._start: CommCounters | None = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = trainer.strategy.comm_counters.snapshot()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._start is not None
        self.per_epoch.append(trainer.strategy.comm_counters.since(self._start).as_dict())


def full_data_loss(model: Classifier, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        return float(nn.functional.cross_entropy(model.net(x), y))


def fit(
    sync: str,
    epochs: int,
    optimizer: str = "adam",
    batchnorm: bool = True,
    daso: dict[str, Any] | None = None,
    probe: bool = False,
    batches: int | None = None,
) -> dict[str, Any]:
    seed_everything(0)
    data = noisy_classification()
    model = Classifier(optimizer, batchnorm)
    probe_callback, bytes_callback = ConsistencyProbe(), EpochBytes()
    callbacks: list[Callback] = [bytes_callback] + ([probe_callback] if probe else [])
    if sync == "daso":
        callbacks.append(DasoScheduleCallback())  # logs daso/* per epoch
    strategy = HorovodStrategy(sync=sync, daso=daso)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=batches,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    daso_holder: dict[str, Any] = {}

    class KeepDaso(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            daso_holder["daso"] = daso_of(trainer.strategy)

    trainer.callbacks.append(KeepDaso())
    trainer.fit(model, DataLoader(data, batch_size=BATCH_SIZE, shuffle=True))
    result: dict[str, Any] = {
        "final_loss": full_data_loss(model, data),
        "bytes_per_epoch": bytes_callback.per_epoch,
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("daso/")},
    }
    if probe:
        result["after_blocking"] = probe_callback.after_blocking
        result["between"] = probe_callback.between
        result["phases_seen"] = sorted(probe_callback.phases_seen)
    daso_sync = daso_holder.get("daso")
    if daso_sync is not None:
        result["history"] = [
            {
                "phase": r.phase.value,
                "global_skips": r.global_skips,
                "batches_to_wait": r.batches_to_wait,
                "loss": r.loss,
            }
            for r in daso_sync.schedule.history
        ]
        result["merges"] = daso_sync.merges
        result["blocking_syncs"] = daso_sync.blocking_syncs
    return result


def set_parameters(model: nn.Module, values: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for parameter in model.parameters():
            parameter.copy_(values[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()


def check_merge_weight() -> dict[str, Any]:
    """DasoSync's non-blocking merge is exactly ``p = (2B * p_local + S) / (2B + N)``, for B = 1 and B = 2.

    Drives a DasoSync directly with parameters set to known per-node values: what each node holds
    when it sends (``sent``) and when the sum arrives B steps later (``local``). Values are multiples
    of 1/4, so float64 parameters with an fp32 wire give the formula exactly. Constant epoch losses
    walk the schedule from its cycling start (4 skips, B=1) over two plateaus to its reset (8, B=2).
    """
    topology = discover_topology()
    groups = build_node_groups(topology)
    config = DasoConfig(
        warmup_epochs=0, cooldown_epochs=0, stable_epochs=1, max_global_skips=8, local_skip_factor=4, downcast="fp32"
    )
    daso = DasoSync(config, groups, CommCounters(), total_epochs=None)
    model = nn.Linear(4, 3).double()  # 15 parameters: an odd count, so the shards of a node are padded
    numel = sum(p.numel() for p in model.parameters())
    set_parameters(model, torch.full((numel,), 0.5, dtype=torch.float64))  # equal everywhere, as setup requires
    daso.setup(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    nodes, node = topology.num_nodes, topology.node_index
    ramp = torch.arange(numel, dtype=torch.float64) * 0.25

    def node_values(k: int, shift: float) -> torch.Tensor:
        return ramp * (k + 1) + shift * (k + 1)  # equal inside a node, different across nodes

    cases = []
    for epoch in range(5):
        skips, wait = daso.schedule.global_skips, daso.schedule.batches_to_wait
        if epoch in (0, 4):
            plans = []
            for _ in range(skips - 1):  # no communication before the sync step
                daso.after_optimizer_step(last_batch_of_epoch=False)
                plans.append(daso.schedule.last_plan.communicates)
            sent = [node_values(k, 1.0) for k in range(nodes)]
            set_parameters(model, sent[node])
            daso.after_optimizer_step(last_batch_of_epoch=False)  # the sync step: send
            send_plan = daso.schedule.last_plan
            for _ in range(wait - 1):  # steps while the message is in flight
                daso.after_optimizer_step(last_batch_of_epoch=False)
                plans.append(daso.schedule.last_plan.communicates)
            local = node_values(node, -2.0 + 0.5 * epoch)
            set_parameters(model, local)
            daso.after_optimizer_step(last_batch_of_epoch=False)  # B steps after the send: receive and merge
            receive_plan = daso.schedule.last_plan
            merged = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            total = torch.stack(sent).sum(dim=0)
            weight = 2 * wait

            def error(expected: torch.Tensor, merged: torch.Tensor = merged) -> float:
                return float((merged - expected).abs().max())

            cases.append(
                {
                    "global_skips": skips,
                    "batches_to_wait": wait,
                    "idle_steps_communicated": any(plans),
                    "send_plan": [send_plan.send, send_plan.receive, send_plan.blocking],
                    "receive_plan": [receive_plan.receive, receive_plan.blocking, receive_plan.merge_wait],
                    "error": error((weight * local + total) / (weight + nodes)),
                    # what other weights would give: the check tells them apart
                    "error_if_weight_b": error((wait * local + total) / (wait + nodes)),
                    "error_if_weight_b_plus_1": error(((wait + 1) * local + total) / (wait + 1 + nodes)),
                    "error_if_plain_average": error(total / nodes),
                    "error_if_local_kept": error(local),
                }
            )
        daso.on_train_epoch_end(1.0)  # closes the epoch with a blocking sync; a constant loss is a plateau
    return {"cases": cases, "nodes": nodes, "merges": daso.merges, "downcast": config.downcast}


EPOCHS = 5
CYCLING = {"warmup_epochs": 1, "cooldown_epochs": 1, "stable_epochs": 2}


def main() -> None:
    out, args = parse_out()
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # DASO registers node and cross-node process sets
    hvd.init()
    results: dict[str, Any] = {}

    def run(name: str, **kwargs: Any) -> Any:
        results[name] = fit(**kwargs)
        return results[name]

    if args.case == "lean":
        checks = {
            "daso": lambda: run("daso", sync="daso", epochs=3, daso=CYCLING, probe=True),
            "merge_weight": check_merge_weight,
        }
    else:
        checks = {
            "merge_weight": check_merge_weight,
            "daso_adam_fp16": lambda: run("daso_adam_fp16", sync="daso", epochs=EPOCHS, daso=CYCLING, probe=True),
            "allreduce_adam": lambda: run("allreduce_adam", sync="allreduce", epochs=EPOCHS),
            "daso_sgd_fp16": lambda: run(
                "daso_sgd_fp16",
                sync="daso",
                epochs=2,
                optimizer="sgd",
                batchnorm=False,
                batches=8,
                daso={"cooldown_epochs": 0, "warmup_epochs": 1},
            ),
            "daso_sgd_fp32": lambda: run(
                "daso_sgd_fp32",
                sync="daso",
                epochs=2,
                optimizer="sgd",
                batchnorm=False,
                batches=8,
                daso={"cooldown_epochs": 0, "warmup_epochs": 1, "downcast": "fp32"},
            ),
            "allreduce_sgd": lambda: run(
                "allreduce_sgd", sync="allreduce", epochs=2, optimizer="sgd", batchnorm=False, batches=8
            ),
        }
    report = run_checks(checks)
    write_result(
        out,
        hvd.rank(),
        {
            "checks": report,
            "cross_rank": hvd.cross_rank(),
            "finite": all(math.isfinite(r["final_loss"]) for r in results.values()),
        },
    )


if __name__ == "__main__":
    main()
