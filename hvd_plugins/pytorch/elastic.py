"""Elastic training inside one ``trainer.fit``: commit in memory, and resume in place after a resize.

Under ``horovodrun --host-discovery-script`` the strategy runs the fit through ``ElasticFit``:

- every ``commit_every_n_steps`` optimizer steps (never on an epoch's last batch) the state a
  checkpoint holds, Lightning's own ``dump_checkpoint``, is copied to host memory and committed;
- a peer that dies makes the next collective raise, a host that appears or leaves is noticed at the
  next commit; Horovod starts again with the new ranks and size, everything shaped by the world is
  dropped, and the fit runs again from the commit, as a resume from a checkpoint would, but from
  memory and in the same ``trainer.fit`` call. A worker that joins gets the commit from rank 0;
- the epoch under way continues over the new workers without skipping a sample
  (``core.elastic.epoch_split``); later epochs are dealt over the new world.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sized
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from typing_extensions import override

from hvd_plugins.core.backend.elastic import ElasticCommits
from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.elastic.attempts import run_attempts
from hvd_plugins.core.elastic.epoch_split import ElasticDistributedSampler, EpochSegments
from hvd_plugins.core.elastic.snapshot import host_copy, rescale_learning_rates
from hvd_plugins.pytorch.loop_events import is_last_batch
from hvd_plugins.pytorch.utilities.callbacks import StepAwareCallback, replace_callback, trainer_callbacks
from hvd_plugins.pytorch.utilities.rank_zero import follow_rank

if TYPE_CHECKING:
    from hvd_plugins.pytorch.strategies.horovod import HorovodStrategy

log = logging.getLogger(__name__)

COMMIT_PATH = "<elastic commit in host memory>"
"""What ``ckpt_path`` the fit is run again with after a reset: the strategy loads the commit for it."""
ELASTIC_KEY = "hvd_plugins_elastic"
"""Where a commit keeps the world it was taken in and how far the epoch got."""
RESET_HOOK = "on_elastic_reset"
"""Callbacks and the LightningModule may define ``on_elastic_reset(trainer, pl_module, old_size, new_size)``."""


class ElasticFit:
    """One strategy's elastic fits: the commit, where the epoch stands, and what a reset rebuilds."""

    def __init__(self, strategy: HorovodStrategy, commit_every_n_steps: int) -> None:
        self.strategy = strategy
        self.commit_every_n_steps = commit_every_n_steps
        self.commits: ElasticCommits | None = None
        self.resets = 0
        """Elastic resets this worker went through (a worker that joined counts from its start)."""
        self.commit_seconds: list[float] = []
        """How long each of this worker's commits took (snapshot, copy, host check)."""
        self.copy_seconds: list[float] = []
        """Of that, taking the snapshot and copying it to host memory (the rest: the check for host changes)."""
        self._epoch = EpochSegments()  # the segments of the epoch under way before this attempt's
        self._segment_start = 0  # the epoch's batches done when this attempt's segment began
        self._batch_size = 0  # of the training batch sampler (0: not a loader whose epoch can be re-split)
        self._share = 0  # samples this worker trains in this segment
        self._world_size = 0  # when the attempt started

    # ------------------------------------------------------------------ the fit
    def fit(self, trainer: Trainer, function: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run Lightning's ``_fit_impl`` until it returns; after a reset again, from the commit."""
        commits = self.commits = ElasticCommits()
        bound = inspect.signature(function).bind(*args, **kwargs)

        def attempt() -> Any:
            if commits.snapshot is not None:
                bound.arguments["ckpt_path"] = COMMIT_PATH
            self._world_size = horovod_torch().size()
            return function(*bound.args, **bound.kwargs)

        return run_attempts(attempt, commits, lambda: self._after_reset(trainer))

    def _after_reset(self, trainer: Trainer) -> None:
        """Horovod runs again, with new ranks: drop what the old world shaped, tell user code."""
        hvd = horovod_torch()
        old_size, new_size = self._world_size, hvd.size()
        self.resets += 1
        follow_rank(hvd.rank())
        trainer._teardown()  # as between two fits: hooks of the old optimizers go, the model goes to the CPU
        self.strategy.forget_world()
        trainer.fit_loop._combined_loader = None  # built for the old world (samplers); built again
        trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
        log.info(
            f"elastic reset {self.resets}: {old_size} -> {new_size} workers; this worker is rank {hvd.rank()}; "
            f"resuming from the commit of global step {self._committed_step()}"
        )
        for owner in [trainer.lightning_module, *trainer_callbacks(trainer)]:
            hook = getattr(owner, RESET_HOOK, None)
            if callable(hook):
                hook(trainer, trainer.lightning_module, old_size, new_size)

    def _committed_step(self) -> int | str:
        snapshot = self.commits.snapshot if self.commits is not None else None
        return snapshot.get("global_step", "?") if snapshot is not None else "none (the fit starts over)"

    # ------------------------------------------------------------------ commits
    def commit(self, trainer: Trainer, batch_idx: int) -> None:
        """Take the snapshot (a checkpoint's content, in host memory) and commit it; may raise a host change."""
        assert self.commits is not None
        start = time.perf_counter()
        snapshot = self.strategy.checkpoint_content(trainer)
        segments = [*self._epoch.segments, (self._world_size, self._samples_done(batch_idx))]
        snapshot[ELASTIC_KEY] = {
            "world_size": self._world_size,
            **EpochSegments(trainer.current_epoch, segments).as_dict(),
            "batches_done": batch_idx + 1,
            "logger_versions": [getattr(logger, "version", None) for logger in trainer.loggers],
        }
        snapshot = host_copy(snapshot)
        self.copy_seconds.append(time.perf_counter() - start)
        try:
            self.commits.commit(snapshot)
        finally:
            self.commit_seconds.append(time.perf_counter() - start)

    def _samples_done(self, batch_idx: int) -> int:
        return min((batch_idx + 1 - self._segment_start) * self._batch_size, self._share)

    def should_commit(self, trainer: Trainer, stepped: bool, batch_idx: int) -> bool:
        return (
            stepped and trainer.global_step % self.commit_every_n_steps == 0 and not is_last_batch(trainer, batch_idx)
        )

    def restore(self, trainer: Trainer | None, scale_lr: bool) -> dict[str, Any]:
        """The commit as a checkpoint to restore (a copy: the commit stays as it was), and where its epoch stood.

        With ``scale_lr`` the learning rates follow the number of workers, as at the start of the fit.
        """
        assert self.commits is not None and self.commits.snapshot is not None
        checkpoint = host_copy(self.commits.snapshot)
        elastic = checkpoint.get(ELASTIC_KEY, {})
        committed_size, size = int(elastic.get("world_size", 0)), horovod_torch().size()
        if scale_lr and committed_size and committed_size != size:
            rescale_learning_rates(checkpoint, size / committed_size)
        self._epoch = EpochSegments.from_dict(elastic)
        self._segment_start = int(elastic.get("batches_done", 0))
        loggers = trainer.loggers if trainer is not None else []
        for logger, version in zip(loggers, elastic.get("logger_versions", []), strict=False):
            if version is not None and hasattr(logger, "_version"):
                logger._version = version  # rank 0's log folder, also when another worker became rank 0
        return checkpoint

    def epoch_ended(self, trainer: Trainer) -> None:
        """A resumed epoch's loader had that epoch's length: build it again for the next, whole epoch."""
        if self._epoch.segments:
            trainer.fit_loop._combined_loader = None
        self._epoch = EpochSegments(trainer.current_epoch + 1)
        self._segment_start = 0

    # ------------------------------------------------------------------ data
    def prepare(self, trainer: Trainer | None, dataloader: object, rank: int, size: int) -> object:
        """The training loader's DistributedSampler becomes one that continues the epoch over this world."""
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or trainer.sanity_checking:
            return dataloader
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        if not isinstance(dataloader, DataLoader) or type(batch_sampler) is not BatchSampler:
            return dataloader
        if type(sampler) is not DistributedSampler:
            log.warning(
                f"elastic training re-splits an epoch after a resize only for Lightning's DistributedSampler; the "
                f"training loader has {type(sampler).__name__}: after a resize the rest of its epoch is taken "
                "from the start of its order again"
            )
            return dataloader
        assert isinstance(batch_sampler, BatchSampler)
        resumed = self._epoch.epoch == trainer.current_epoch and self._segment_start > 0
        progress = self._epoch if resumed else EpochSegments(trainer.current_epoch)
        done_before = self._segment_start * batch_sampler.batch_size if resumed else 0
        assert isinstance(sampler.dataset, Sized)  # DistributedSampler needs its length too
        elastic = ElasticDistributedSampler(
            sampler.dataset, size, rank, sampler.shuffle, sampler.seed, sampler.drop_last, progress, done_before
        )
        elastic.set_epoch(trainer.current_epoch)
        batch_sampler.sampler = elastic
        self._epoch = progress
        self._segment_start = self._segment_start if resumed else 0
        self._batch_size = batch_sampler.batch_size
        self._share = len(elastic) - done_before
        return dataloader


class ElasticCommitCallback(StepAwareCallback):
    """Commits every ``commit_every_n_steps`` steps; installed by the strategy in an elastic launch."""

    def __init__(self, elastic: ElasticFit) -> None:
        self.elastic = elastic

    @classmethod
    def install(cls, trainer: Trainer, elastic: ElasticFit) -> None:
        replace_callback(trainer, cls, cls(elastic))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.elastic.should_commit(trainer, self.stepped(trainer), batch_idx):
            self.elastic.commit(trainer, batch_idx)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.elastic.epoch_ended(trainer)
