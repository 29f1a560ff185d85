"""Elastic training inside one ``trainer.fit``: commit in memory, and resume in place after a resize.

Under ``horovodrun --host-discovery-script`` the strategy's launcher (``HorovodElasticLauncher``) runs the fit:

- every ``commit_every_n_steps`` optimizer steps (never on an epoch's last batch) the state a
  checkpoint holds, Lightning's own ``dump_checkpoint``, is copied to host memory and committed;
- a peer that dies makes the next collective raise, a host that appears or leaves is noticed at the
  next commit; Horovod starts again with the new ranks and size, everything shaped by the world is
  dropped, and the fit runs again from the commit, as a resume from a checkpoint would, but from
  memory and in the same ``trainer.fit`` call. A worker that joins gets the commit from rank 0;
- the epoch under way continues over the new workers without skipping a sample
  (``core.elastic.cursor``, ``core.elastic.epoch_split``); later epochs are dealt over the new world.

``ElasticFit`` is the state of this: the commits, where the epoch stands, resets and commit timings.
It knows no strategy; what it needs of one comes as arguments.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sized
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from typing_extensions import override

from hvd_plugins.core.backend.elastic import ElasticCommits
from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.elastic.cursor import EpochCursor, committed_world_size
from hvd_plugins.core.elastic.epoch_split import ElasticDistributedSampler
from hvd_plugins.core.elastic.snapshot import give_own_parts, host_copy, rescale_learning_rates, take_own_parts
from hvd_plugins.fabric.lightning_internals import forget_training_loader, set_logger_version
from hvd_plugins.pytorch.loop_events import is_last_batch
from hvd_plugins.pytorch.utilities.callbacks import StepAwareCallback, replace_callback

log = logging.getLogger(__name__)

ELASTIC_KEY = "hvd_plugins_elastic"
"""Where a commit keeps the world it was taken in and how far the epoch got."""
RESET_HOOK = "on_elastic_reset"
"""Callbacks and the LightningModule may define ``on_elastic_reset(trainer, pl_module, old_size, new_size)``."""


class ElasticFit:
    """One strategy's elastic fits: the commits, where the epoch stands, resets and what commits cost."""

    def __init__(self, commit_every_n_steps: int) -> None:
        self.commit_every_n_steps = commit_every_n_steps
        self.commits: ElasticCommits | None = None
        self.resets = 0
        """Elastic resets this worker went through (a worker that joined counts from its start)."""
        self.commit_seconds: list[float] = []
        """How long each of this worker's commits took (snapshot, copy, host check)."""
        self.copy_seconds: list[float] = []
        """Of that, taking the snapshot and copying it to host memory (the rest: the check for host changes)."""
        self.cursor = EpochCursor()
        """Where the epoch under way stands, across resets."""
        self.world_size = 0
        """Workers when the attempt under way started."""
        self.held: tuple[int, list[Any]] | None = None
        """The global step of the last commit and the parts of sharded optimizer states this worker keeps of it:
        its own, not rank 0's, so they stay out of the snapshot every worker gets from rank 0."""

    # ------------------------------------------------------------------ attempts
    def start_fit(self) -> ElasticCommits:
        """A fit begins: no commit yet (a failure before the first one starts the fit over)."""
        self.commits = ElasticCommits()
        self.held = None
        return self.commits

    def start_attempt(self) -> bool:
        """An attempt of the fit begins in the world Horovod has now; returns whether it resumes from a commit."""
        self.world_size = horovod_torch().size()
        return self.commits is not None and self.commits.snapshot is not None

    def committed_step(self) -> int | str:
        """The global step of the commit the fit resumes from, for the log."""
        snapshot = self.commits.snapshot if self.commits is not None else None
        return snapshot.get("global_step", "?") if snapshot is not None else "none (the fit starts over)"

    # ------------------------------------------------------------------ commits
    def should_commit(self, trainer: Trainer, stepped: bool, batch_idx: int) -> bool:
        return (
            stepped and trainer.global_step % self.commit_every_n_steps == 0 and not is_last_batch(trainer, batch_idx)
        )

    def commit(self, trainer: Trainer, batch_idx: int, content: Callable[[], dict[str, Any]]) -> None:
        """Commit ``content()`` (a checkpoint's content) with where the epoch stands, copied to host memory; may
        raise a host change."""
        if self.commits is None:
            raise RuntimeError("ElasticFit.commit outside an elastic fit: HorovodElasticLauncher starts the fit")
        start = time.perf_counter()
        snapshot = content()
        self.cursor.batches_done = batch_idx + 1  # Lightning's batch index counts the epoch over all attempts
        snapshot[ELASTIC_KEY] = {
            **self.cursor.commit_state(self.world_size),
            "logger_versions": [getattr(logger, "version", None) for logger in trainer.loggers],
        }
        held = take_own_parts(snapshot)
        snapshot = host_copy(snapshot)
        self.copy_seconds.append(time.perf_counter() - start)
        self.held = (snapshot.get("global_step", -1), held)  # bytes on the CPU already
        try:
            self.commits.commit(snapshot)
        finally:
            self.commit_seconds.append(time.perf_counter() - start)

    def restore(self, trainer: Trainer | None, scale_lr: bool) -> dict[str, Any]:
        """The commit as a checkpoint to restore (a copy: the commit stays as it was), and where its epoch stood.

        With ``scale_lr`` the learning rates follow the number of workers, as at the start of the fit.
        """
        if self.commits is None or self.commits.snapshot is None:
            raise RuntimeError("ElasticFit.restore without a commit: the launcher resumes only from one")
        checkpoint = host_copy(self.commits.snapshot)
        step, held = self.held if self.held is not None else (None, None)
        give_own_parts(checkpoint, held if step == checkpoint.get("global_step") else None)  # parts of this commit only
        elastic = checkpoint.get(ELASTIC_KEY, {})
        committed_size, size = committed_world_size(elastic), horovod_torch().size()
        if scale_lr and committed_size and committed_size != size:
            rescale_learning_rates(checkpoint, size / committed_size)
        self.cursor.restore(elastic)
        loggers = trainer.loggers if trainer is not None else []
        for logger, version in zip(loggers, elastic.get("logger_versions", []), strict=False):
            set_logger_version(logger, version)  # rank 0's log folder, also when another worker became rank 0
        return checkpoint

    def epoch_ended(self, trainer: Trainer) -> None:
        """A resumed epoch's loader had that epoch's length: build it again for the next, whole epoch."""
        if self.cursor.next_epoch():
            forget_training_loader(trainer)

    # ------------------------------------------------------------------ data
    def prepare(self, trainer: Trainer | None, dataloader: object) -> object:
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
        assert isinstance(batch_sampler, BatchSampler)  # checked above
        assert isinstance(sampler.dataset, Sized)  # DistributedSampler needs its length too
        epoch, cursor, hvd = trainer.current_epoch, self.cursor, horovod_torch()
        progress = cursor.progress() if cursor.continues(epoch) else None
        done_before = cursor.samples_before(epoch, batch_sampler.batch_size)
        size, rank, shuffle, seed = hvd.size(), hvd.rank(), sampler.shuffle, sampler.seed
        elastic = ElasticDistributedSampler(
            sampler.dataset, size, rank, shuffle, seed, sampler.drop_last, progress, done_before
        )
        elastic.set_epoch(epoch)
        batch_sampler.sampler = elastic
        cursor.begin_segment(epoch, batch_sampler.batch_size, len(elastic) - done_before)
        return dataloader


class ElasticCommitCallback(StepAwareCallback):
    """Commits every ``commit_every_n_steps`` steps; installed by the strategy in an elastic launch.

    ``content(trainer)`` is what a checkpoint saved now would hold (the strategy's ``checkpoint_content``).
    """

    def __init__(self, elastic: ElasticFit, content: Callable[[Trainer], dict[str, Any]]) -> None:
        self.elastic = elastic
        self.content = content

    @classmethod
    def install(cls, trainer: Trainer, elastic: ElasticFit, content: Callable[[Trainer], dict[str, Any]]) -> None:
        replace_callback(trainer, cls, cls(elastic, content))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.elastic.should_commit(trainer, self.stepped(trainer), batch_idx):
            self.elastic.commit(trainer, batch_idx, lambda: self.content(trainer))

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.elastic.epoch_ended(trainer)
