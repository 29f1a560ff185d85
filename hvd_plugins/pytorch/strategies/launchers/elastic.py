"""Lightning's launcher in an elastic job: it runs ``trainer.fit`` again, in place, after every elastic reset.

horovodrun started the workers, so this launcher starts nothing. Lightning hands every stage to a
launcher, and as its own launchers own their processes, this one owns the attempts of a fit: it
runs Lightning's fit until it returns, and after a reset (a peer lost, hosts changed) it ends the
fit as between two fits, has the strategy forget the old world, tells user code and runs the fit
again from the commit. Validation, testing and prediction run once, as without elastic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.elastic.attempts import run_attempts
from hvd_plugins.core.training_state import shape_placeholders_
from hvd_plugins.fabric.lightning_internals import (
    TrainerLauncher,
    end_fit_in_place,
    fit_arguments_resuming_commit,
    forget_fit_loaders,
)
from hvd_plugins.pytorch.elastic import RESET_HOOK, ElasticFit
from hvd_plugins.pytorch.utilities.callbacks import trainer_callbacks

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class HorovodElasticLauncher(TrainerLauncher):
    """Runs ``trainer.fit`` elastically; the other stages as they are.

    Args:
        elastic: the strategy's elastic state (commits, epoch cursor, resets).
        forget_world: the strategy's ``forget_world``, run after each reset (rank-zero output, watchdog, sync).
    """

    def __init__(self, elastic: ElasticFit, forget_world: Callable[[], None]) -> None:
        self.elastic = elastic
        self.forget_world = forget_world

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False  # horovodrun starts scripts

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return function(*args, **kwargs)
        commits = self.elastic.start_fit()

        def attempt() -> Any:
            if self.elastic.start_attempt():  # after a reset: Lightning restores the commit, as a checkpoint
                resumed_args, resumed_kwargs = fit_arguments_resuming_commit(function, args, kwargs)
                return function(*resumed_args, **resumed_kwargs)
            return function(*args, **kwargs)

        return run_attempts(
            attempt, commits, lambda: self._after_reset(trainer), reset_number=lambda: self.elastic.resets + 1
        )

    def _after_reset(self, trainer: pl.Trainer) -> None:
        """Horovod runs again, with new ranks: drop what the old world shaped, tell user code."""
        hvd = horovod_torch()
        old_size, new_size = self.elastic.world_size, hvd.size()
        self.elastic.resets += 1
        self.forget_world()  # first: what follows prints as the new rank
        end_fit_in_place(trainer)  # as between two fits: hooks of the old optimizers go, the model goes to the CPU
        shape_placeholders_(trainer.lightning_module)  # sharded units' (ZeRO-3): made real again at the next setup
        forget_fit_loaders(trainer)  # their samplers were the old world's
        log.info(
            f"elastic reset {self.elastic.resets}: {old_size} -> {new_size} workers; this worker is rank "
            f"{hvd.rank()}; resuming from the commit of global step {self.elastic.committed_step()}"
        )
        for owner in [trainer.lightning_module, *trainer_callbacks(trainer)]:
            hook = getattr(owner, RESET_HOOK, None)
            if callable(hook):
                hook(trainer, trainer.lightning_module, old_size, new_size)

    @override
    def kill(self, signum: int) -> None:
        """horovodrun owns the workers; nothing of this process's own to pass the signal to."""
