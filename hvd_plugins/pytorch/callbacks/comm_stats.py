"""Per-epoch communication volume and wait time, node-local vs cross-node, from the strategy's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.pytorch.callbacks._gather import format_table, gather_rows, log_to_loggers

_COUNTER_FIELDS = tuple(f.name for f in fields(CommCounters))


@dataclass
class EpochTraffic:
    """What the workers handed to collectives during one training epoch (after compression).

    ``per_worker[name]`` lists the values of ranks 0, 1, ... for every ``CommCounters`` field.
    """

    epoch: int
    per_worker: dict[str, list[float]]

    def mean(self, name: str) -> float:
        values = self.per_worker[name]
        return sum(values) / len(values)

    def bandwidth_mb_per_s(self) -> float:
        """Bytes per second of blocked waiting, per worker: a lower bound on the link speed
        when communication does not overlap computation (overlapped transfers cost no wait)."""
        wait = self.mean("wait_seconds")
        total = self.mean("node_local_bytes") + self.mean("cross_node_bytes")
        return total / wait / 2**20 if wait > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """``comm/<field>`` as the mean over workers, plus ``comm/bandwidth_mb_per_s``."""
        result = {f"comm/{name}": self.mean(name) for name in _COUNTER_FIELDS}
        result["comm/bandwidth_mb_per_s"] = self.bandwidth_mb_per_s()
        return result


class CommunicationMonitor(Callback):
    """Logs, per training epoch, bytes and calls node-local vs cross-node, wait time and bandwidth.

    Reads ``trainer.strategy.comm_counters`` (a ``CommCounters``), so it sees exactly what
    HorovodStrategy handed to Horovod: gradients (after compression) and DASO's parameter
    syncs. Values are per worker, averaged over workers; ``history`` keeps each worker's own.
    With any other strategy it warns once and does nothing.

    Args:
        print_table: print one row per epoch on rank 0 when training ends.
    """

    def __init__(self, print_table: bool = True) -> None:
        self.print_table = print_table
        self.history: list[EpochTraffic] = []
        self._epoch_start: CommCounters | None = None

    @staticmethod
    def _counters(trainer: Trainer) -> CommCounters | None:
        counters = getattr(trainer.strategy, "comm_counters", None)
        return counters if isinstance(counters, CommCounters) else None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.history = []
        if self._counters(trainer) is None:
            rank_zero_warn(
                f"CommunicationMonitor: {type(trainer.strategy).__name__} has no comm_counters; "
                "nothing will be measured (use hvd_plugins.HorovodStrategy)."
            )

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        counters = self._counters(trainer)
        self._epoch_start = None if counters is None else counters.snapshot()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        counters = self._counters(trainer)
        if counters is None or self._epoch_start is None:
            return
        delta = asdict(counters.since(self._epoch_start))
        rows = gather_rows(trainer, [float(delta[name]) for name in _COUNTER_FIELDS])
        traffic = EpochTraffic(
            epoch=trainer.current_epoch,
            per_worker={name: [row[i] for row in rows] for i, name in enumerate(_COUNTER_FIELDS)},
        )
        self.history.append(traffic)
        log_to_loggers(trainer, traffic.metrics())

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.print_table and self.history and trainer.is_global_zero:
            print(self.table(), flush=True)

    def table(self) -> str:
        """One row per epoch: MiB and calls per worker, wait seconds and bandwidth."""
        header = ("epoch", "local MiB", "local calls", "cross MiB", "cross calls", "wait s", "MiB/s waited")
        rows = [
            (
                t.epoch,
                t.mean("node_local_bytes") / 2**20,
                int(round(t.mean("node_local_calls"))),
                t.mean("cross_node_bytes") / 2**20,
                int(round(t.mean("cross_node_calls"))),
                t.mean("wait_seconds"),
                t.bandwidth_mb_per_s(),
            )
            for t in self.history
        ]
        workers = len(self.history[0].per_worker[_COUNTER_FIELDS[0]]) if self.history else 0
        return f"Communication per worker (mean of {workers} worker(s), after compression)\n" + format_table(
            header, rows
        )
