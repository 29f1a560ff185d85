"""Bad configuration and bad numbers, many cases in one launch: every case must fail the same way on
every rank (so the ranks stay in step and the next case can run), or behave identically.

``checks`` run inside the two-worker job of tests/workers/strategy_features.py; run as a script
(``horovodrun -np 2``) it runs them alone, after a plain ``hvd.init()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch
from _common import Checks, parse_out, write_result
from faults_common import digest, trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from models import FaultNet, fault_loader

from hvd_plugins import DasoConfig
from hvd_plugins.pytorch import HorovodStrategy

BAD_BATCH = 3
checks = Checks()
"""In the order they run: every failing case first, then whether the ranks are still in step."""


def first_error(run: Callable[[], Any]) -> str:
    """Run a fit that must fail; return 'Type: message' (the check records it for pytest to compare)."""
    try:
        run()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def mine(values: tuple[Any, Any]) -> Any:
    return values[min(hvd.rank(), 1)]


def fit(strategy: HorovodStrategy, module: FaultNet | None = None, epochs: int = 1, **kwargs: Any) -> FaultNet:
    module = module or FaultNet()
    trainer(strategy, epochs=epochs, **kwargs).fit(module, fault_loader(n=128))
    return module


def poison_on_rank_1(value: float) -> Callable[[FaultNet, int], torch.Tensor | None]:
    def on_step(module: FaultNet, batch_idx: int) -> torch.Tensor | None:
        if hvd.rank() == 1 and batch_idx == BAD_BATCH:
            return torch.tensor(value)
        return None

    return on_step


def weights_finite(module: FaultNet) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def nan_stops_training() -> dict[str, Any]:
    module = FaultNet(on_step=poison_on_rank_1(math.nan))
    error = first_error(lambda: fit(HorovodStrategy(check_finite_gradients=True), module))
    return {"error": error, "weights_finite": weights_finite(module), "digest": digest(module)}


def nan_without_check() -> dict[str, Any]:
    module = fit(HorovodStrategy(), FaultNet(on_step=poison_on_rank_1(math.nan)))
    return {"weights_finite": weights_finite(module)}


def inf_under_bf16() -> str:
    module = FaultNet(on_step=poison_on_rank_1(math.inf))
    return first_error(lambda: fit(HorovodStrategy(check_finite_gradients=True), module, precision="bf16-mixed"))


NO_CPU_SCALER = None if hasattr(torch.amp, "GradScaler") else f"torch {torch.__version__} has no CPU GradScaler (2.3+)"


def scaler_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def check_with_grad_scaler() -> str:
    if NO_CPU_SCALER:
        return f"skipped: {NO_CPU_SCALER}"
    return first_error(lambda: fit(HorovodStrategy(check_finite_gradients=True), plugins=[scaler_plugin()]))


def grad_scaler_skips_everywhere() -> dict[str, Any]:
    """fp16 autocast + GradScaler on CPU: an inf on rank 1 must make every rank skip the same step."""
    if NO_CPU_SCALER:
        return {"skipped": NO_CPU_SCALER}
    plugin = scaler_plugin()
    module = fit(HorovodStrategy(), FaultNet(on_step=poison_on_rank_1(math.inf)), plugins=[plugin])
    return {"digest": digest(module), "scale": float(plugin.scaler.get_scale()), "finite": weights_finite(module)}


@checks.register
def compression_differs() -> str:
    return first_error(lambda: fit(HorovodStrategy(compression=mine(("none", "fp16")))))


@checks.register
def op_differs() -> str:
    return first_error(lambda: fit(HorovodStrategy(op=mine(("average", "sum")))))


@checks.register
def parameter_shapes_differ() -> str:
    return first_error(lambda: fit(HorovodStrategy(), FaultNet(hidden=mine((8, 9)))))


@checks.register
def optimizer_count_differs() -> str:
    return first_error(lambda: fit(HorovodStrategy(), FaultNet(optimizers=mine((1, 2)))))


@checks.register
def daso_settings_differ() -> str:
    return first_error(lambda: fit(HorovodStrategy(sync="daso", daso=DasoConfig(warmup_epochs=mine((4, 2))))))


@checks.register
def devices_disagree_with_the_job() -> str:
    return first_error(lambda: fit(HorovodStrategy(), devices=3))


@checks.register
def num_nodes_disagree_with_the_job() -> str:
    return first_error(lambda: fit(HorovodStrategy(), num_nodes=3))


checks.register(nan_stops_training)
checks.register(nan_without_check)
checks.register(inf_under_bf16)
checks.register(check_with_grad_scaler)
checks.register(grad_scaler_skips_everywhere)


@checks.register
def still_in_step() -> str:
    """After every failed case above, the ranks still train in step."""
    return digest(fit(HorovodStrategy()))


if __name__ == "__main__":
    OUT, ARGS = parse_out()
    hvd.init()
    write_result(OUT, hvd.rank(), checks.selected(ARGS.case).run())
