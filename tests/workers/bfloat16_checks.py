"""bfloat16 end to end on real workers: Horovod's collectives, bf16-true training, bf16 on the wire.

Run under ``horovodrun --gloo`` (2 workers, or 4 on two emulated nodes) or ``mpirun`` (the
collectives only: ``--case check_collectives,check_adasum_refuses_bfloat16``). Needs a Horovod
that takes bfloat16 (``hvd-build-horovod``).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks, parse_out, write_result
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.core.sync.daso.config import DasoConfig
from hvd_plugins.fabric import HorovodStrategy as FabricHorovodStrategy
from hvd_plugins.pytorch import HorovodStrategy

checks = Checks()
SAMPLES = 256
BATCH = 8


# ----------------------------------------------------------------------------------------- collectives
def bf16_ulps(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |got - expected| in units of the last place of bfloat16 at ``expected``."""
    expected32 = expected.float()
    magnitude = expected32.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    ulp = torch.pow(2.0, torch.floor(torch.log2(magnitude)) - 7)
    return float(((got.float() - expected32).abs() / ulp).max()) if got.numel() else 0.0


def every_rank(values: torch.Tensor) -> torch.Tensor:
    """Each worker's bfloat16 ``values`` as float32 rows (exact: float32 holds every bfloat16)."""
    return hvd.allgather(values.float().unsqueeze(0), name=f"probe.{values.numel()}")


def rounded(reference: torch.Tensor) -> torch.Tensor:
    """The float32 result, rounded to bfloat16: what a bfloat16 collective should return."""
    return reference.float().to(torch.bfloat16)


@checks.register
def check_collectives() -> dict[str, Any]:
    """Every collective on bfloat16 against the float32 result rounded to bfloat16; sums in ulps."""
    rank, size = hvd.rank(), hvd.size()
    found: dict[str, Any] = {"size": size, "nodes": hvd.cross_size()}  # several nodes: the two-level sums
    for numel in (3, 1001, 65_536):  # 3 < 4 workers: some slices of the float32 sum are empty
        values = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)
        rows = every_rank(values)
        total = rows.double().sum(0)
        sums = {
            "sum": (hvd.allreduce(values, op=hvd.Sum, name=f"sum.{numel}"), total),
            "average": (hvd.allreduce(values, op=hvd.Average, name=f"avg.{numel}"), total / size),
        }
        handle = hvd.allreduce_async(values, op=hvd.Sum, name=f"async.{numel}")
        sums["async_sum"] = (hvd.synchronize(handle), total)
        grouped = hvd.grouped_allreduce([values, values[: numel // 2 + 1]], op=hvd.Sum, name=f"grouped.{numel}")
        sums["grouped_sum"] = (torch.cat(grouped), torch.cat([total, total[: numel // 2 + 1]]))
        slice_rows = numel // size * size
        if slice_rows:
            mine = slice(rank * (slice_rows // size), (rank + 1) * (slice_rows // size))
            scattered = hvd.reducescatter(values[:slice_rows], op=hvd.Sum, name=f"rs.{numel}")
            sums["reducescatter_sum"] = (scattered, total[:slice_rows][mine])
            scattered = hvd.reducescatter(values[:slice_rows], op=hvd.Average, name=f"rsavg.{numel}")
            sums["reducescatter_average"] = (scattered, total[:slice_rows][mine] / size)
        for name, (got, reference) in sums.items():
            found[f"{name}.{numel}.dtype"] = str(got.dtype)
            found[f"{name}.{numel}.ulps"] = bf16_ulps(got, rounded(reference))
        exact = {
            "max": (hvd.allreduce(values, op=hvd.Max, name=f"max.{numel}"), rows.max(0).values),
            "min": (hvd.allreduce(values, op=hvd.Min, name=f"min.{numel}"), rows.min(0).values),
            "allgather": (hvd.allgather(values.unsqueeze(0), name=f"gather.{numel}"), rows),
            "broadcast": (hvd.broadcast(values, root_rank=size - 1, name=f"bcast.{numel}"), rows[size - 1]),
        }
        per_peer = numel // size
        if per_peer:
            received = hvd.alltoall(values[: per_peer * size], name=f"a2a.{numel}")
            exact["alltoall"] = (received, rows[:, rank * per_peer : (rank + 1) * per_peer].reshape(-1))
        for name, (got, reference) in exact.items():
            found[f"{name}.{numel}.dtype"] = str(got.dtype)
            found[f"{name}.{numel}.equal"] = bool(torch.equal(got.float(), reference.float()))
    return found


@checks.register
def check_adasum_refuses_bfloat16() -> str:
    """Adasum has no bfloat16: the error says so when the tensor is enqueued, on every controller.

    The refusal involves no other rank, so a barrier keeps a rank that got it from ending the job
    (and shutting Horovod down) before the others have asked."""
    try:
        hvd.allreduce(torch.ones(4, dtype=torch.bfloat16), op=hvd.Adasum, name="adasum.bf16")
    except Exception as error:
        message = str(error)
    else:
        message = "accepted"
    hvd.barrier()
    return message


# ----------------------------------------------------------------------------------------- training
class Net(pl.LightningModule):
    """6 -> 16 -> 1, with a BatchNorm unless ``batchnorm=False``; SGD or Adam."""

    def __init__(self, optimizer: str = "adam", batchnorm: bool = True) -> None:
        super().__init__()
        torch.manual_seed(7)
        norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.net = nn.Sequential(nn.Linear(6, 16), norm, nn.Tanh(), nn.Linear(16, 1))
        self.optimizer = optimizer
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x.to(self.dtype)).float(), y.float())
        self.losses.append(float(loss))
        return loss

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(SAMPLES, 6, generator=generator)
        y = (x[:, :2].sum(1, keepdim=True) - x[:, 2:3]).tanh()
        return DataLoader(TensorDataset(x, y), batch_size=BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return torch.optim.Adam(self.parameters(), lr=0.01)


def fit(
    precision: str, epochs: int = 3, optimizer: str = "adam", batchnorm: bool = True, **strategy: Any
) -> tuple[Net, pl.Trainer]:
    model = Net(optimizer, batchnorm)
    trainer = pl.Trainer(
        strategy=HorovodStrategy(**strategy),
        accelerator="cpu",
        precision=precision,  # type: ignore[arg-type]
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return model, trainer


def same_everywhere(model: nn.Module) -> bool:
    state = torch.cat([t.detach().float().reshape(-1) for t in model.state_dict().values() if t.is_floating_point()])
    rows = hvd.allgather(state.unsqueeze(0), name="probe.state")
    return all(torch.equal(rows[0], row) for row in rows)


def training_report(model: Net, trainer: pl.Trainer) -> dict[str, Any]:
    first, last = sum(model.losses[:8]) / 8, sum(model.losses[-8:]) / 8
    counters = trainer.strategy.comm_counters  # type: ignore[attr-defined]
    return {
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "same_on_every_rank": same_everywhere(model),
        "finite": all(math.isfinite(loss) for loss in model.losses),
        "first_loss": first,
        "last_loss": last,
        "cross_node_bytes": counters.cross_node_bytes,
        "node_local_bytes": counters.node_local_bytes,
    }


def sync_modes() -> dict[str, dict[str, Any]]:
    modes: dict[str, dict[str, Any]] = {
        "allreduce": {},
        "allreduce_fp16_wire": {"compression": "fp16"},
        "shard_optimizer": {"shard": "optimizer"},
        "shard_gradients": {"shard": "gradients"},
    }
    if hvd.size() > hvd.local_size():  # several nodes
        modes["hierarchical"] = {"sync": "hierarchical"}
        modes["hierarchical_shard_gradients"] = {"sync": "hierarchical", "shard": "gradients"}
        modes["daso"] = {
            "sync": "daso",
            "daso": DasoConfig(warmup_epochs=1, cooldown_epochs=1, downcast="bf16", cycling="always"),
        }
    return modes


@checks.register
def check_bf16_true_trains() -> dict[str, Any]:
    """precision='bf16-true' trains with every sync mode: bfloat16 weights, one model on every rank, loss down."""
    return {mode: training_report(*fit("bf16-true", epochs=4, **options)) for mode, options in sync_modes().items()}


@checks.register
def check_fabric_bf16_true_trains() -> dict[str, Any]:
    """Fabric(precision='bf16-true') in a plain loop: bfloat16 weights, one model on every rank, loss down."""
    found = {}
    for sync in ["allreduce"] + (["hierarchical"] if hvd.size() > hvd.local_size() else []):
        fabric = Fabric(accelerator="cpu", strategy=FabricHorovodStrategy(sync=sync), precision="bf16-true")
        fabric.launch()
        model = Net(batchnorm=False)  # a plain module here: Fabric never calls its hooks
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(model.train_dataloader())
        for _ in range(3):
            for x, y in loader:
                loss = nn.functional.mse_loss(model.net(x.to(torch.bfloat16)).float(), y.float())
                model.losses.append(float(loss))
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        counters = fabric.strategy.comm_counters  # type: ignore[attr-defined]
        found[sync] = {
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "same_on_every_rank": same_everywhere(model),
            "finite": all(math.isfinite(loss) for loss in model.losses),
            "first_loss": sum(model.losses[:8]) / 8,
            "last_loss": sum(model.losses[-8:]) / 8,
            "bytes": counters.cross_node_bytes + counters.node_local_bytes,
        }
    return found


@checks.register
def check_a_build_without_bfloat16_refuses() -> dict[str, str]:
    """With the build's answer forced to 'no bfloat16' (Horovod 0.28.1's), each way to ask for bfloat16
    stops before any step, with the error that names the build command."""
    from hvd_plugins.core.backend import bfloat16

    real = bfloat16.takes_bfloat16
    bfloat16.takes_bfloat16 = lambda hvd: False  # what Horovod 0.28.1's extension answers
    asks = {
        "bf16-true": lambda: fit("bf16-true", epochs=1),
        "compression": lambda: fit("32-true", epochs=1, compression="bf16"),
        "daso": lambda: fit("32-true", epochs=1, sync="daso", daso=DasoConfig(downcast="bf16")),
    }
    found = {}
    try:
        for name, ask in asks.items():
            try:
                model, _ = ask()
                found[name] = f"trained {len(model.losses)} steps"
            except bfloat16.BFloat16Unsupported as error:
                found[name] = str(error)
    finally:
        bfloat16.takes_bfloat16 = real
    return found


@checks.register
def check_bf16_compression_halves_bytes() -> dict[str, Any]:
    """compression='bf16' sends half of fp32's bytes, flat and (on two nodes) two-level, and trains like fp32."""
    found = {}
    modes = ["allreduce"] + (["hierarchical"] if hvd.size() > hvd.local_size() else [])
    for sync in modes:
        exact_model, exact = fit("32-true", sync=sync)
        bf16_model, bf16 = fit("32-true", sync=sync, compression="bf16")
        exact_params = torch.cat([p.detach().reshape(-1) for p in exact_model.parameters()])
        bf16_params = torch.cat([p.detach().reshape(-1) for p in bf16_model.parameters()])
        found[sync] = {
            "fp32": training_report(exact_model, exact),
            "bf16": training_report(bf16_model, bf16),
            "parameter_difference": float((exact_params - bf16_params).abs().max() / exact_params.abs().max()),
        }
    return found


@checks.register
def check_daso_bf16_halves_bytes() -> dict[str, Any]:
    """DASO with downcast='bf16' sends half of fp32's bytes across nodes, and as many as fp16 (SGD: no state;
    no BatchNorm, whose float32 buffers are averaged in float32 whatever the downcast)."""
    if hvd.size() == hvd.local_size():
        return {"skipped": "one node"}
    found = {}
    for downcast in ("fp32", "fp16", "bf16"):
        daso = DasoConfig(warmup_epochs=1, cooldown_epochs=1, downcast=downcast, cycling="always")  # type: ignore[arg-type]
        found[downcast] = training_report(
            *fit("32-true", epochs=4, optimizer="sgd", batchnorm=False, sync="daso", daso=daso)
        )
    state = {}
    for downcast_state in (False, True):
        daso = DasoConfig(warmup_epochs=0, cooldown_epochs=0, downcast="bf16", downcast_optimizer_state=downcast_state)
        state[str(downcast_state)] = training_report(*fit("32-true", epochs=2, batchnorm=False, sync="daso", daso=daso))
    found["adam_state"] = state
    return found


if __name__ == "__main__":
    out, args = parse_out()
    hvd.init()
    torch.set_num_threads(1)
    write_result(out, hvd.rank(), checks.selected(args.case).run())
    sys.exit(0)
