"""Lightning's launcher for ``HorovodRayStrategy``: the Trainer's function runs in Ray actors, rank 0's outcome
comes back to the driver.

As Lightning's spawn launcher does, the Trainer and its arguments travel to every worker; the driver's Trainer then
takes rank 0's state, ``callback_metrics`` and the best checkpoint's path, after ``fit`` rank 0's weights too (into
the driver's model), and ``fit``/``validate``/``test``/``predict`` return rank 0's results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from hvd_plugins.core.backend.ray_workers import current_rank
from hvd_plugins.core.backend.startup import init_horovod
from hvd_plugins.fabric.lightning_internals import TrainerLauncher
from hvd_plugins.fabric.strategies.launchers.ray import RayFabricLauncher, to_cpu
from hvd_plugins.pytorch.strategies.horovod import HorovodStrategy
from hvd_plugins.pytorch.strategies.launchers.elastic import HorovodElasticLauncher

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclass
class RankZeroOutcome:
    """What the driver's Trainer takes from rank 0 once the workers are done."""

    results: Any
    weights: dict[str, torch.Tensor] | None  # after a fit only
    state: Any
    callback_metrics: dict[str, Any]
    best_model_path: str | None


def run_in_worker(
    follow_rank: Callable[[int], None], trainer: pl.Trainer, function: Callable, args: tuple, kwargs: dict
) -> RankZeroOutcome | None:
    """In each actor: rank-zero output on its rank from the start, the Trainer's function, then rank 0's outcome
    (after a fit every worker reads the weights alike: a sharded model's state dict is a collective)."""
    follow_rank(current_rank())
    results = run_stage(trainer, function, args, kwargs)
    module = trainer.lightning_module
    fitted = trainer.state.fn == TrainerFn.FITTING and module is not None
    weights = to_cpu(module.state_dict()) if fitted and module is not None else None
    if current_rank() != 0:
        return None
    callback = trainer.checkpoint_callback
    return RankZeroOutcome(
        results=to_cpu(results),
        weights=weights,
        state=trainer.state,
        callback_metrics=to_cpu(dict(trainer.callback_metrics)),
        best_model_path=getattr(callback, "best_model_path", None) if callback is not None else None,
    )


def run_stage(trainer: pl.Trainer, function: Callable, args: tuple, kwargs: dict) -> Any:
    """The Trainer's function in a worker: an elastic fit runs its attempts as under an elastic ``horovodrun``
    (``HorovodElasticLauncher``: resets in place, from the last commit, Horovod started first as a script under
    horovodrun starts it when the Trainer is built); everything else runs once."""
    strategy = trainer.strategy
    if not isinstance(strategy, HorovodStrategy) or strategy.elastic is None:
        return function(*args, **kwargs)
    init_horovod(strategy.config)
    return HorovodElasticLauncher(strategy.elastic, strategy.forget_world).launch(
        function, *args, trainer=trainer, **kwargs
    )


def take_outcome(trainer: pl.Trainer, outcome: RankZeroOutcome) -> Any:
    """The driver's Trainer as rank 0's ended: its state, metrics and best checkpoint path, and after a fit its
    weights (what the driver's model lacks, a layer ``configure_model`` adds in the workers, is left out; a model
    built on the meta device takes rank 0's tensors)."""
    module = trainer.lightning_module
    if module is not None and outcome.weights is not None:
        on_meta = any(tensor.is_meta for tensor in (*module.parameters(), *module.buffers()))
        module.load_state_dict(outcome.weights, strict=False, assign=on_meta)
    trainer.state = outcome.state
    trainer.callback_metrics.update(outcome.callback_metrics)
    callback = trainer.checkpoint_callback
    if callback is not None and outcome.best_model_path is not None and hasattr(callback, "best_model_path"):
        callback.best_model_path = outcome.best_model_path
    return outcome.results


class RayLauncher(RayFabricLauncher, TrainerLauncher):
    """Starts ``spec.num_workers`` Horovod workers as Ray actors for each ``fit``/``validate``/``test``/``predict``,
    and stops them when it ends."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        assert trainer is not None  # Lightning's Trainer passes itself
        follow_rank = self.follow_rank
        outcomes = self._run_on_workers(lambda: run_in_worker(follow_rank, trainer, function, args, kwargs))
        return take_outcome(trainer, outcomes[0])

    @override
    def kill(self, signum: int) -> None:
        super().kill(signum)
