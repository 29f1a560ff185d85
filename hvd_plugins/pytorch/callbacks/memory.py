"""Peak memory of every worker, and what it holds of the training state, gathered to rank 0: the worker that runs
out first decides the batch size, and sharding changes what each one holds."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer
from typing_extensions import override

from hvd_plugins.pytorch.callbacks._gather import format_table, gather_rows, log_to_loggers

_MB = 2.0**20


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """This process's peak memory so far, in MiB; measures this platform lacks are left out.

    ``cpu_peak_rss_mb``: peak resident set size (``getrusage``, or psutil where that is missing).
    ``gpu_peak_allocated_mb`` / ``gpu_peak_reserved_mb``: tensors allocated / memory held by
    PyTorch's caching allocator on ``device``, when it is a CUDA device.
    """
    readings: dict[str, float] = {}
    rss = _peak_rss_bytes()
    if rss is not None:
        readings["cpu_peak_rss_mb"] = rss / _MB
    if device.type == "cuda" and torch.cuda.is_available():
        readings["gpu_peak_allocated_mb"] = torch.cuda.max_memory_allocated(device) / _MB
        readings["gpu_peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / _MB
    return readings


def _peak_rss_bytes() -> float | None:
    try:
        import resource
    except ImportError:  # Windows
        return _psutil_peak_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


def _psutil_peak_bytes() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    info = psutil.Process().memory_info()
    return float(getattr(info, "peak_wset", info.rss))


def training_state_mb(module: torch.nn.Module, optimizers: list[Optimizer]) -> dict[str, float]:
    """What this worker holds of the training state, in MiB: its parameters, gradients and optimizer state.

    A sharded optimizer holds its state and its gradients for this worker's slices, and with
    ``shard="parameters"`` the units' parameters as slices too; it says which (``state_bytes``,
    ``owned_gradients``, ``sliced_parameters``). A unit's parameters and their gradients are views of those
    slices between computations: each memory is counted once.
    """
    parameters: list[torch.Tensor] = [p.detach() for p in module.parameters()]
    gradients: list[torch.Tensor] = [p.grad for p in module.parameters() if p.grad is not None]
    state = 0
    for optimizer in optimizers:
        if hasattr(optimizer, "state_bytes") and hasattr(optimizer, "owned_gradients"):
            state += optimizer.state_bytes()
            gradients += optimizer.owned_gradients()
            parameters += getattr(optimizer, "sliced_parameters", lambda: [])()
            continue
        for values in optimizer.state.values():
            state += sum(v.numel() * v.element_size() for v in values.values() if isinstance(v, torch.Tensor))
    return {
        "parameters_mb": _distinct_bytes(parameters) / _MB,
        "gradients_mb": _distinct_bytes(gradients) / _MB,
        "optimizer_state_mb": state / _MB,
    }


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the memory ``tensors`` hold, each block once however many of them view it."""
    blocks: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        blocks[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(blocks.values())


@dataclass
class MemorySnapshot:
    """One measurement point: ``per_worker[measure]`` lists the values of ranks 0, 1, ..."""

    stage: str
    epoch: int
    per_worker: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """``memory/<measure>_min`` and ``_max`` across workers."""
        metrics = {}
        for measure, values in self.per_worker.items():
            metrics[f"memory/{measure}_min"] = min(values)
            metrics[f"memory/{measure}_max"] = max(values)
        return metrics


class PeakMemoryMonitor(Callback):
    """Measures peak memory, and the bytes of parameters, gradients and optimizer state each worker holds, on every
    worker at train start, each epoch end and train end.

    The values of all workers are gathered (a collective, so every worker takes part), kept in
    ``history`` on every rank, sent to the Trainer's loggers as ``memory/<measure>_min|_max``, and
    shown as one table on rank 0 at the end of training.

    Args:
        print_table: print the min/max table on rank 0 when training ends.
    """

    def __init__(self, print_table: bool = True) -> None:
        self.print_table = print_table
        self.history: list[MemorySnapshot] = []

    def _measure(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> MemorySnapshot:
        readings = {**peak_memory_mb(pl_module.device), **training_state_mb(pl_module, trainer.optimizers)}
        measures = sorted(readings)  # same device kind on every worker, so the same measures
        rows = gather_rows(trainer, [readings[name] for name in measures])
        snapshot = MemorySnapshot(
            stage=stage,
            epoch=trainer.current_epoch,
            per_worker={name: [row[i] for row in rows] for i, name in enumerate(measures)},
        )
        self.history.append(snapshot)
        log_to_loggers(trainer, snapshot.summary())
        return snapshot

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.history = []
        self._measure(trainer, pl_module, "train_start")

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._measure(trainer, pl_module, "epoch_end")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._measure(trainer, pl_module, "train_end")
        if self.print_table and trainer.is_global_zero:
            print(self.table(), flush=True)

    def table(self) -> str:
        """Min and max across workers (and the rank holding the max) at every measurement point."""
        rows = []
        for snapshot in self.history:
            for measure, values in snapshot.per_worker.items():
                worst = max(range(len(values)), key=values.__getitem__)
                rows.append((snapshot.stage, snapshot.epoch, measure, min(values), max(values), worst))
        workers = len(next(iter(self.history[0].per_worker.values()), [])) if self.history else 0
        header = ("stage", "epoch", "measure (MiB)", "min", "max", "max on rank")
        return f"Peak memory over {workers} worker(s)\n" + format_table(header, rows)
