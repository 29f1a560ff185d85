"""Every private attribute, function, class and module of Lightning this package touches; nowhere else knows them.

Lightning keeps some of what a third-party strategy needs behind leading underscores: the launcher
base class, the strategy's launcher and layer-sync slots, the Trainer's teardown between two fits,
the loops' cached data loaders, a logger's version. Each use goes through a small function here,
named for what it does, so a Lightning release that moves one needs a change in this module only,
and ``tests/unit/fabric/test_lightning_internals.py`` names the one that moved. ``TOUCHED`` lists
them all, with the hooks Lightning defines with an underscore that the strategies override.

The Fabric face must run without the Trainer, so this module imports no Trainer code when it loads:
Trainer objects are reached through their attributes, and the Trainer's private classes
(``TrainerLauncher``, ``TrainerConnector``) are imported when first asked for. The same source
serves ``lightning_fabric`` and ``pytorch_lightning`` as ``hvd_plugins.lightning_fabric.lightning_internals``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.connector import _Connector as FabricConnector
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.strategies.launchers.launcher import _Launcher as FabricLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH as CheckpointPath
from torch.optim import Optimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.layer_sync import LayerSync
    from lightning.pytorch.strategies.launchers.launcher import _Launcher as TrainerLauncher
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as TrainerConnector

__all__ = [
    "TOUCHED",
    "BackwardSyncControl",
    "CheckpointPath",
    "FabricConnector",
    "FabricLauncher",
    "TrainerConnector",
    "TrainerLauncher",
    "allow_compiled_models",
    "checkpoint_content",
    "count_summaries_with",
    "end_fit_in_place",
    "fabric_optimizer_target",
    "fit_arguments_resuming_commit",
    "forget_fit_loaders",
    "forget_training_loader",
    "given_checkpoint_io",
    "layer_sync",
    "lightning_optimizers",
    "module_trainer",
    "names_the_commit",
    "optimizers_to_device",
    "override_cluster_environment_choice",
    "set_backward_sync_control",
    "set_checkpoint_io",
    "set_launcher",
    "set_layer_sync",
    "set_logger_version",
]

How = Literal["defined", "set on instances", "hook", "called by name"]


@dataclass(frozen=True)
class Private:
    """One private name of Lightning this package relies on, and how the test finds it still there."""

    module: str
    """The ``lightning.*`` module that defines it (the standalone packages' twin is checked as well)."""
    name: str
    """``Name`` in that module, or ``Class.name`` for a member of one of its classes."""
    how: How
    """``defined``: the module or class has it; ``set on instances``: a class of its MRO uses ``self.<name>``;
    ``hook``: a method of the class that a strategy here overrides; ``called by name``: the class calls a method of
    that name on a strategy, which a strategy here defines."""
    why: str


FABRIC, TRAINER = "lightning.fabric", "lightning.pytorch"
_CONNECTOR = f"{TRAINER}.trainer.connectors.accelerator_connector"

TOUCHED: tuple[Private, ...] = (
    # classes and types a strategy needs
    Private(f"{FABRIC}.strategies.launchers.launcher", "_Launcher", "defined", "base of Fabric's launchers"),
    Private(f"{TRAINER}.strategies.launchers.launcher", "_Launcher", "defined", "base of the Trainer's launchers"),
    Private(f"{FABRIC}.strategies.strategy", "_BackwardSyncControl", "defined", "what no_backward_sync asks"),
    Private(f"{FABRIC}.utilities.types", "_PATH", "defined", "the path type of the checkpoint hooks"),
    Private(f"{FABRIC}.utilities.optimizer", "_optimizers_to_device", "defined", "optimizer state to the device"),
    # the cluster environment picked for a strategy named by a string (fabric/strategies/cluster_choice.py)
    Private(f"{FABRIC}.connector", "_Connector", "defined", "Fabric's connector, told our names"),
    Private(f"{FABRIC}.connector", "_Connector._choose_and_init_cluster_environment", "defined", "wrapped"),
    Private(f"{FABRIC}.connector", "_Connector._strategy_flag", "set on instances", "the name asked for"),
    Private(f"{FABRIC}.connector", "_Connector._cluster_environment_flag", "set on instances", "one given is kept"),
    Private(_CONNECTOR, "_AcceleratorConnector", "defined", "the Trainer's connector, told our names"),
    Private(_CONNECTOR, "_AcceleratorConnector._choose_and_init_cluster_environment", "defined", "wrapped"),
    Private(_CONNECTOR, "_AcceleratorConnector._strategy_flag", "set on instances", "the name asked for"),
    Private(_CONNECTOR, "_AcceleratorConnector._cluster_environment_flag", "set on instances", "one given is kept"),
    # a strategy's slots that Lightning reads
    Private(f"{FABRIC}.strategies.strategy", "Strategy._launcher", "set on instances", "the launcher Fabric runs"),
    Private(f"{TRAINER}.strategies.strategy", "Strategy._launcher", "set on instances", "the launcher a stage runs"),
    Private(f"{FABRIC}.strategies.strategy", "Strategy._checkpoint_io", "set on instances", "the IO given, if any"),
    Private(f"{TRAINER}.strategies.strategy", "Strategy._checkpoint_io", "set on instances", "the IO given, if any"),
    Private(f"{FABRIC}.strategies.strategy", "Strategy._backward_sync_control", "set on instances", "holds syncs"),
    Private(f"{TRAINER}.strategies.parallel", "ParallelStrategy._layer_sync", "set on instances", "sync_batchnorm"),
    Private(f"{TRAINER}.strategies.strategy", "Strategy._lightning_optimizers", "set on instances", "their zero_grad"),
    # hooks with an underscore that the strategies define
    Private(f"{FABRIC}.strategies.strategy", "Strategy._configure_launcher", "hook", "sets the launcher"),
    Private(f"{TRAINER}.strategies.strategy", "Strategy._configure_launcher", "hook", "sets the launcher"),
    Private(f"{FABRIC}.connector", "_Connector._set_world_ranks", "called by name", "Horovod starts there"),
    # the Trainer, reached through its attributes (elastic fits, the strategy's trainer)
    Private(f"{TRAINER}.trainer.trainer", "Trainer._teardown", "defined", "ends a fit before an elastic reset"),
    Private(f"{TRAINER}.trainer.trainer", "Trainer._fit_impl", "defined", "the fit a launcher runs (ckpt_path)"),
    Private(f"{TRAINER}.trainer.trainer", "Trainer._checkpoint_connector", "set on instances", "an elastic commit"),
    Private(f"{TRAINER}.loops.fit_loop", "_FitLoop._combined_loader", "set on instances", "dropped after a reset"),
    Private(f"{TRAINER}.loops.evaluation_loop", "_EvaluationLoop._combined_loader", "set on instances", "also"),
    Private(f"{TRAINER}.core.module", "LightningModule._trainer", "set on instances", "None when detached"),
    Private(f"{FABRIC}.loggers.csv_logs", "CSVLogger._version", "set on instances", "rank 0's folder after a reset"),
    Private(f"{FABRIC}.loggers.tensorboard", "TensorBoardLogger._version", "set on instances", "the same"),
    Private(f"{FABRIC}.wrappers", "_FabricOptimizer._optimizer", "set on instances", "what zero_grad works on"),
    # the Trainer's model summary counts whole parameters (shard="parameters" holds shards)
    Private(f"{TRAINER}.callbacks.model_summary", "ModelSummary._summary", "defined", "wrapped: counts whole"),
    Private(f"{TRAINER}.utilities.model_summary", "ModelSummary._model", "set on instances", "its parameters"),
    Private(f"{TRAINER}.utilities.model_summary", "ModelSummary._layer_summary", "set on instances", "its layers"),
    Private(f"{TRAINER}.utilities.model_summary", "LayerSummary._module", "set on instances", "a layer's module"),
    # compiled models (pytorch/strategies/horovod.py)
    Private(f"{TRAINER}.trainer.trainer", "_verify_strategy_supports_compile", "defined", "wrapped: lets ours compile"),
)
"""What this package touches of Lightning's private names, by module (checked by the unit test)."""

_TRAINER_CLASSES = {
    "TrainerLauncher": (f"{TRAINER}.strategies.launchers.launcher", "_Launcher"),
    "TrainerConnector": (_CONNECTOR, "_AcceleratorConnector"),
}
"""The Trainer's private classes, imported on first use so that the Fabric face never loads the Trainer."""


def __getattr__(name: str) -> Any:
    """``TrainerLauncher`` (base of the Trainer's launchers) and ``TrainerConnector``, from the Trainer's package."""
    if name not in _TRAINER_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _TRAINER_CLASSES[name]
    return getattr(importlib.import_module(module), attribute)


# ---------------------------------------------------------------------------- strategies (both packages)
def set_launcher(strategy: Any, launcher: FabricLauncher | None) -> None:
    """Set ``Strategy._launcher``: Lightning reads the launcher from there, ``_configure_launcher`` has to fill it."""
    strategy._launcher = launcher


def given_checkpoint_io(strategy: Any) -> CheckpointIO | None:
    """``Strategy._checkpoint_io``: the CheckpointIO given to the strategy or as a plugin, None when none was."""
    given: CheckpointIO | None = strategy._checkpoint_io
    return given


def set_checkpoint_io(strategy: Any, io: CheckpointIO | None) -> None:
    """Set ``Strategy._checkpoint_io``, which Lightning's constructor and connectors also write."""
    strategy._checkpoint_io = io


def set_backward_sync_control(strategy: Any, control: BackwardSyncControl) -> None:
    """Set Fabric's ``Strategy._backward_sync_control``: ``fabric.no_backward_sync`` asks it to hold back syncs."""
    strategy._backward_sync_control = control


def optimizers_to_device(optimizers: Iterable[Optimizer], device: torch.device) -> None:
    """``_optimizers_to_device``: move optimizer state to ``device``, as Lightning's own strategies do at setup."""
    _optimizers_to_device(optimizers, device)


_OVERRIDDEN = "_hvd_plugins_overridden"
"""Marks the wrapper ``override_cluster_environment_choice`` installs."""


def override_cluster_environment_choice(
    connector: type, choose: Callable[[Any, Any], ClusterEnvironment | None]
) -> None:
    """Wrap a connector class's ``_choose_and_init_cluster_environment``: ``choose(strategy_flag,
    cluster_environment_flag)`` (its ``_strategy_flag``, ``_cluster_environment_flag``) decides first, and
    None leaves the choice to Lightning. Once per connector class: a second call changes nothing."""
    original: Callable[[Any], ClusterEnvironment] | None = getattr(
        connector, "_choose_and_init_cluster_environment", None
    )
    if original is None or hasattr(original, _OVERRIDDEN):
        return

    def choose_and_init(self: Any) -> ClusterEnvironment:
        chosen = choose(getattr(self, "_strategy_flag", None), getattr(self, "_cluster_environment_flag", None))
        return chosen if chosen is not None else original(self)

    setattr(choose_and_init, _OVERRIDDEN, True)
    connector._choose_and_init_cluster_environment = choose_and_init  # type: ignore[attr-defined]


def allow_compiled_models(strategy_class: type) -> None:
    """Wrap the Trainer's ``_verify_strategy_supports_compile`` so that it lets ``strategy_class`` train, validate,
    test and predict with a ``torch.compile``-d LightningModule; every other strategy is judged by Lightning as before.

    Lightning refuses a compiled model under any strategy but its own single-device, DDP and FSDP ones, by
    class. Once per Trainer package: a second call changes nothing."""
    trainer_module = importlib.import_module(f"{TRAINER}.trainer.trainer")
    original: Callable[[Any, Any], None] | None = getattr(trainer_module, "_verify_strategy_supports_compile", None)
    if original is None or hasattr(original, _OVERRIDDEN):
        return

    def verify_strategy_supports_compile(model: Any, strategy: Any) -> None:
        if not isinstance(strategy, strategy_class):
            original(model, strategy)

    setattr(verify_strategy_supports_compile, _OVERRIDDEN, True)
    trainer_module._verify_strategy_supports_compile = verify_strategy_supports_compile  # type: ignore[attr-defined]


def fabric_optimizer_target(optimizer: Any) -> Any:
    """The optimizer Fabric's ``_FabricOptimizer`` wraps (``_optimizer`` in its ``__dict__``), else ``optimizer``.

    Read from ``__dict__``: a class attribute or property of the wrapped optimizer's own class must not count."""
    return optimizer.__dict__.get("_optimizer", optimizer)


# ---------------------------------------------------------------------------- the Trainer's strategy
def layer_sync(strategy: Any) -> LayerSync | None:
    """``ParallelStrategy._layer_sync``: the Trainer puts its ``sync_batchnorm`` plugin there."""
    sync: LayerSync | None = strategy._layer_sync
    return sync


def set_layer_sync(strategy: Any, sync: LayerSync | None) -> None:
    """Set ``ParallelStrategy._layer_sync``, for the strategy's own synchronized BatchNorm."""
    strategy._layer_sync = sync


def lightning_optimizers(strategy: Any) -> list[Any]:
    """``Strategy._lightning_optimizers``: the LightningOptimizer wrappers the Trainer hands to user code."""
    wrappers: list[Any] = strategy._lightning_optimizers
    return wrappers


# ---------------------------------------------------------------------------- the Trainer, by attribute
def module_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """``LightningModule._trainer``: the Trainer a module is attached to, None when it is not (its ``trainer``
    property raises then)."""
    return module._trainer if module is not None else None


def count_summaries_with(trainer: pl.Trainer, numel: Callable[[torch.nn.Parameter], int]) -> None:
    """The Trainer's model summary callbacks (``ModelSummary._summary``) count each parameter's elements with
    ``numel``: under ``shard="parameters"`` a parameter holds this worker's shard, and the summary should show the
    model, as it does for FSDP's parameters (a DTensor counts its whole)."""
    from torch.nn.parameter import UninitializedParameter

    summary_callback = importlib.import_module(f"{TRAINER}.callbacks").ModelSummary  # the Trainer's, when asked

    def counted(parameters: Iterable[torch.nn.Parameter]) -> int:
        return sum(numel(p) for p in parameters if not isinstance(p, UninitializedParameter))

    class Counted:
        """Lightning's summary with its counts of elements taken from ``numel``."""

        @property
        def param_nums(self) -> list[int]:
            return [counted(layer._module.parameters()) for layer in self._layer_summary.values()]  # type: ignore[attr-defined]

        @property
        def total_parameters(self) -> int:
            return counted(self._model.parameters())  # type: ignore[attr-defined]

        @property
        def trainable_parameters(self) -> int:
            return counted(p for p in self._model.parameters() if p.requires_grad)  # type: ignore[attr-defined]

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, summary_callback) and not getattr(callback, "_hvd_plugins_counted", False):
            made = callback._summary

            def summary(trainer: Any, module: Any, made: Callable[..., Any] = made) -> Any:
                found = made(trainer, module)
                found.__class__ = type(f"Counted{type(found).__name__}", (Counted, type(found)), {})
                return found

            callback._summary = summary
            callback._hvd_plugins_counted = True


def checkpoint_content(trainer: pl.Trainer) -> dict[str, Any]:
    """What a checkpoint saved now holds (``trainer._checkpoint_connector.dump_checkpoint``), without writing it."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def end_fit_in_place(trainer: pl.Trainer) -> None:
    """``Trainer._teardown``: what Lightning does between two fits (strategy teardown, loops, loggers, signals)."""
    trainer._teardown()


def forget_fit_loaders(trainer: pl.Trainer) -> None:
    """Drop the fit's cached training and validation loaders (``_combined_loader``): the next run builds them."""
    trainer.fit_loop._combined_loader = None
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def forget_training_loader(trainer: pl.Trainer) -> None:
    """Drop the cached training loader only (``fit_loop._combined_loader``): the next epoch builds it again."""
    trainer.fit_loop._combined_loader = None


def set_logger_version(logger: Any, version: Any) -> bool:
    """Set a logger's ``_version`` (the folder it writes to), when it has one; returns whether it had."""
    if version is None or not hasattr(logger, "_version"):
        return False
    logger._version = version
    return True


# ---------------------------------------------------------------------------- resuming a fit from memory
COMMIT_PATH = "<elastic commit in host memory>"
"""The ``ckpt_path`` a fit resumed after an elastic reset runs with: Lightning hands it to the strategy's
``load_checkpoint``, which restores the commit instead of reading a file."""


def fit_arguments_resuming_commit(
    fit: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of the fit function a launcher runs (``Trainer._fit_impl``), with ``ckpt_path`` naming the
    elastic commit; Lightning then restores it as it restores a checkpoint file."""
    bound = inspect.signature(fit).bind(*args, **kwargs)
    bound.arguments["ckpt_path"] = COMMIT_PATH
    return bound.args, bound.kwargs


def names_the_commit(path: CheckpointPath | None) -> bool:
    """Whether a ``ckpt_path`` Lightning passes on is the one ``fit_arguments_resuming_commit`` set."""
    return path == COMMIT_PATH
