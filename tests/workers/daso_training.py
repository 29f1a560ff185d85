"""DASO fits and probes run under horovodrun on emulated nodes (entry point: tests/workers/daso_checks.py).

Consistency after every step and every epoch, rounds per step from the counters, final loss,
bytes on the wire, and the merge weight driven directly on a DasoParameterSync.
"""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from models import DASO_BATCH_SIZE, MlpClassifier, Stream, noisy_classification
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.comm.topology import build_node_groups, start_horovod_and_discover
from hvd_plugins.core.sync.daso.config import DasoConfig
from hvd_plugins.core.sync.daso.parameter_sync import DasoParameterSync
from hvd_plugins.pytorch import HorovodStrategy
from hvd_plugins.pytorch.callbacks import DasoScheduleCallback


def model_state(model: LightningModule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat parameters, floating optimizer state (every optimizer, ``step`` included) and floating buffers."""
    params = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    state = [
        v.reshape(-1).float()
        for optimizer in model.trainer.strategy.optimizers
        for p in model.parameters()
        for _, v in sorted(optimizer.state.get(p, {}).items())
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    ]
    buffers = [b.reshape(-1).float() for b in model.buffers() if b.is_floating_point()]
    empty = torch.zeros(0)
    return params, torch.cat(state) if state else empty, torch.cat(buffers) if buffers else empty


class ConsistencyProbe(Callback):
    """One allgather of (parameters, optimizer state, buffers) after every step and at every epoch end.

    After a warmup or cooldown step: parameters and optimizer state bit-identical on all workers.
    After a cycling step: equal inside each node, different across nodes. After every epoch (the
    cycling epoch's closing blocking sync, the synchronous epoch's buffer average): parameters,
    optimizer state and buffers bit-identical on all workers. Also counts, per step, the tensors
    handed to collectives inside the node and across nodes (the comm counters).
    """

    def __init__(self) -> None:
        self.synchronous_steps = {"checked": 0, "params_equal": 0, "state_equal": 0}
        self.epoch_ends = {"checked": 0, "params_equal": 0, "state_equal": 0, "buffers_equal": 0}
        self.between = {"checked": 0, "node_agrees": 0, "nodes_differ": 0}
        self.calls_per_step: dict[str, list[list[float]]] = {}
        self.state_equal_per_epoch: list[bool] = []
        self.blocking_syncs_after_epoch: list[int] = []
        self.synced_parameters_per_epoch: list[int] = []
        self.phases_seen: set[str] = set()
        self.daso: Any = None
        self._counters: CommCounters | None = None
        self._epoch_start_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.daso = trainer.strategy.daso_sync

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start_step = trainer.global_step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        counters = trainer.strategy.comm_counters
        if batch_idx > 0 and self._counters is not None:  # the previous step, its gradient average included
            phase = self.daso.schedule.phase
            self.phases_seen.add(phase.value)
            delta = counters.since(self._counters)
            self.calls_per_step.setdefault(phase.value, []).append(
                [delta.cross_node_calls, delta.node_local_calls, delta.cross_node_bytes]
            )
            if phase.synchronous:
                self._check_synchronous(trainer, pl_module)
            elif trainer.global_step > self._epoch_start_step:  # the nodes stepped apart since the epoch began
                self._check_nodes(trainer, pl_module)
        self._counters = counters.snapshot()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows, sizes = self._gather(pl_module, "probe.epoch_end")
        counts = self.epoch_ends
        counts["checked"] += 1
        for key, part in zip(("params_equal", "state_equal", "buffers_equal"), _split(rows, sizes), strict=True):
            equal = all(torch.equal(part[0], row) for row in part)
            counts[key] += int(equal)
            if key == "state_equal":
                self.state_equal_per_epoch.append(equal)
        self.blocking_syncs_after_epoch.append(self.daso.blocking_syncs)
        self.synced_parameters_per_epoch.append(sum(p.numel() for p in self.daso.parameters))

    def _gather(self, pl_module: LightningModule, name: str) -> tuple[torch.Tensor, list[int]]:
        parts = model_state(pl_module)
        return hvd.allgather(torch.cat(parts).unsqueeze(0), name=name), [part.numel() for part in parts]

    def _check_synchronous(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows, sizes = self._gather(pl_module, "probe.step")
        params, state, _ = _split(rows, sizes)
        self.synchronous_steps["checked"] += 1
        self.synchronous_steps["params_equal"] += int(all(torch.equal(params[0], row) for row in params))
        self.synchronous_steps["state_equal"] += int(all(torch.equal(state[0], row) for row in state))

    def _check_nodes(self, trainer: Trainer, pl_module: LightningModule) -> None:
        nodes = trainer.strategy.topology.nodes
        rows, sizes = self._gather(pl_module, "probe.step")
        params, state, _ = _split(rows, sizes)
        both = torch.cat([params, state], dim=1)
        self.between["checked"] += 1
        self.between["node_agrees"] += int(all(torch.equal(both[node[0]], both[r]) for node in nodes for r in node))
        self.between["nodes_differ"] += int(not torch.equal(params[nodes[0][0]], params[nodes[1][0]]))

    def result(self) -> dict[str, Any]:
        return {
            "synchronous_steps": self.synchronous_steps,
            "epoch_ends": self.epoch_ends,
            "between": self.between,
            "calls_per_step": self.calls_per_step,
            "state_equal_per_epoch": self.state_equal_per_epoch,
            "blocking_syncs_after_epoch": self.blocking_syncs_after_epoch,
            "synced_parameters_per_epoch": self.synced_parameters_per_epoch,
            "phases_seen": sorted(self.phases_seen),
        }


def _split(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(rows.split(sizes, dim=1))


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


def full_data_loss(model: MlpClassifier, data: TensorDataset) -> float:
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
    batches: int | None = 8,
    model: MlpClassifier | None = None,
    callbacks: list[Callback] | None = None,
    accumulate: int = 1,
    data: Any = None,
) -> dict[str, Any]:
    """One fit on every rank; with DASO the ConsistencyProbe and the schedule's history are reported."""
    seed_everything(0)
    dataset = noisy_classification()
    model = model if model is not None else MlpClassifier(optimizer, batchnorm)
    probe, bytes_callback = ConsistencyProbe(), EpochBytes()
    extra: list[Callback] = [bytes_callback, *(callbacks or [])]
    if sync == "daso":
        extra += [probe, DasoScheduleCallback()]  # the callback logs daso/* per epoch
    trainer = Trainer(
        strategy=HorovodStrategy(sync=sync, daso=daso),
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=batches,
        accumulate_grad_batches=accumulate,
        callbacks=extra,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data if data is not None else DataLoader(dataset, batch_size=DASO_BATCH_SIZE, shuffle=True))
    result: dict[str, Any] = {
        "final_loss": full_data_loss(model, dataset),
        "bytes_per_epoch": bytes_callback.per_epoch,
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("daso/")},
    }
    if sync == "daso":
        daso_sync = probe.daso
        result.update(probe.result())
        result["history"] = [
            {"phase": r.phase.value, "global_skips": r.global_skips, "batches_to_wait": r.batches_to_wait}
            | {"loss": r.loss}
            for r in daso_sync.schedule.history
        ]
        result["merges"] = daso_sync.merges
        result["blocking_syncs"] = daso_sync.blocking_syncs
    return result


def refuses_iterable_without_length() -> str:
    """DASO refuses, on every rank at once, training data whose batch count is unknown."""
    try:
        fit("daso", epochs=1, batches=None, daso={"warmup_epochs": 0}, data=DataLoader(Stream(), batch_size=16))
    except ValueError as error:
        return str(error)
    return "no error"


def set_parameters(model: nn.Module, values: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for parameter in model.parameters():
            parameter.copy_(values[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()


def check_merge_weight() -> dict[str, Any]:
    """DasoParameterSync's non-blocking merge is exactly ``p = (2B * p_local + S) / (2B + N)``, for B = 1 and B = 2.

    Drives a DasoParameterSync directly with parameters set to known per-node values: what each node holds
    when it sends (``sent``) and when the sum arrives B steps later (``local``). Values are multiples
    of 1/4, so float64 parameters with an fp32 wire give the formula exactly. Constant epoch losses
    walk the schedule (patience 0) from its cycling start (4, 1, 1) over (2, 1, 1) and (1, 1, 1) to its reset (8, 2, 2).
    """
    topology = start_horovod_and_discover(hvd)  # the layout DasoParameterSync reaches its partners by
    groups = build_node_groups(topology)
    config = DasoConfig(
        warmup_epochs=0, cooldown_epochs=0, stable_epochs=0, max_global_skips=8, local_skip_factor=4, downcast="fp32"
    )
    daso = DasoParameterSync(config, groups, CommCounters(), total_epochs=None)
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
        daso.on_train_epoch_end(lambda: 1.0)  # closes the epoch with a blocking sync; a constant loss is a plateau
    return {"cases": cases, "nodes": nodes, "merges": daso.merges, "downcast": config.downcast}


CLOSING_CASES = ((torch.float64, "fp32"), (torch.float32, "fp32"), (torch.float32, "fp16"))
"""Parameter dtype and wire: two messages (fp32 parameters, float64 momentum), one (both float32),
two again (fp16 parameters, float32 momentum)."""


def check_closing_average() -> dict[str, Any]:
    """DASO's closing blocking sync gives every worker the average over all workers, exactly.

    Parameters and momentum are set equal inside each node and different across nodes (as
    cycling leaves them); BatchNorm's running means differ on every worker. Values are multiples
    of 1/4 small enough for float16, so the averages are exact on every wire. The node's workers
    carry one shard each across nodes, so a worker's cross-node bytes are its shard of each
    message, not all of it, and the buffers (averaged over all workers).
    """
    topology = start_horovod_and_discover(hvd)
    return {"cases": [_closing_average(topology, dtype, downcast) for dtype, downcast in CLOSING_CASES]}


def _closing_average(topology: Any, dtype: torch.dtype, downcast: str) -> dict[str, Any]:
    counters = CommCounters()
    config = DasoConfig(warmup_epochs=0, cooldown_epochs=0, downcast=downcast)
    daso = DasoParameterSync(config, build_node_groups(topology), counters, total_epochs=None)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(dtype)  # 21 parameters: shards are padded
    numel = sum(p.numel() for p in model.parameters())
    set_parameters(model, torch.zeros(numel, dtype=dtype))  # equal everywhere, as setup requires
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    daso.setup(model, [optimizer])
    ramp = torch.arange(numel, dtype=dtype) * 0.25
    node, nodes = topology.node_index, topology.num_nodes
    per_node = [ramp * (k + 1) + 0.5 * k for k in range(nodes)]  # equal inside a node
    set_parameters(model, per_node[node])
    offset = 0
    for parameter in model.parameters():
        piece = (ramp[offset : offset + parameter.numel()] + 1.0) * (node + 1)
        optimizer.state[parameter]["momentum_buffer"] = piece.view_as(parameter).clone()
        offset += parameter.numel()
    per_rank = [torch.arange(3, dtype=dtype) + 0.25 * r for r in range(hvd.size())]
    model[1].running_mean.copy_(per_rank[hvd.rank()])
    before = counters.snapshot()
    daso.after_optimizer_step(last_batch_of_epoch=True)  # a cycling epoch's last batch: the blocking sync
    moved = counters.since(before)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    momentum = torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    node_factor = sum(k + 1 for k in range(nodes)) / nodes
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "downcast": downcast,
        "blocking": daso.schedule.last_plan.blocking,
        "param_error": float((params - torch.stack(per_node).mean(dim=0)).abs().max()),
        "momentum_error": float((momentum - (ramp + 1.0) * node_factor).abs().max()),
        "buffer_error": float((model[1].running_mean - torch.stack(per_rank).mean(dim=0)).abs().max()),
        "numel": numel,
        "local_size": topology.local_size,
        "cross_node_bytes": moved.cross_node_bytes,
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point()),
    }
