"""Lightning's launcher in an elastic job: ``trainer.fit`` runs through ``ElasticFit``, in place after resets.

horovodrun started the workers, so this launcher starts nothing; Lightning hands every stage to a
launcher, and this is where a fit can be run again from the commit after Horovod started anew.
Validation, testing and prediction run once, as without elastic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from hvd_plugins.pytorch.elastic import ElasticFit

if TYPE_CHECKING:
    import lightning.pytorch as pl


class HorovodElasticLauncher(_Launcher):
    """Runs ``trainer.fit`` elastically; the other stages as they are."""

    def __init__(self, elastic: ElasticFit) -> None:
        self.elastic = elastic

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False  # horovodrun starts scripts

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return function(*args, **kwargs)
        return self.elastic.fit(trainer, function, args, kwargs)

    @override
    def kill(self, signum: int) -> None:
        """horovodrun owns the workers; nothing of this process's own to pass the signal to."""
