"""Resume a checkpoint taken inside an epoch at the batch after it, not at the epoch's start again.

Lightning restores a mid-epoch checkpoint's counters but restarts a plain DataLoader from its first
batch, so the rest of that epoch would train on batches already seen. The strategy records how many
batches of the epoch were done when it saved, and at the resume the training DataLoader's batch
sampler skips exactly those sample indices (no batch is loaded to be dropped). The distributed
sampler's order depends only on seed and epoch, so the resumed run sees what an uninterrupted one
would have seen.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sized
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

POSITION_KEY = "hvd_plugins_epoch_position"


def epoch_position(trainer: Trainer) -> dict[str, int]:
    """For a checkpoint: the epoch and how many of its training batches are done (0 once it is finished)."""
    done = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)  # type: ignore[attr-defined]
    total = trainer.num_training_batches
    return {"epoch": trainer.current_epoch, "batches_done": done if done < total else 0}


def batches_to_skip(checkpoint: dict[str, Any]) -> int:
    """The training batches a resume from ``checkpoint`` must skip in its first epoch."""
    return int(checkpoint.get(POSITION_KEY, {}).get("batches_done", 0))


class _SkipFirst:
    """A sampler that leaves out its first ``skip`` indices once, then gives the batch sampler its sampler back."""

    def __init__(self, batch_sampler: BatchSampler, skip: int, epoch: int) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = batch_sampler.sampler
        self.skip = skip
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.batch_sampler.sampler = self.sampler  # later epochs iterate the original
        if hasattr(self.sampler, "set_epoch"):  # Lightning may create the iterator before it sets the epoch
            self.sampler.set_epoch(self.epoch)
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        assert isinstance(self.sampler, Sized)
        return len(self.sampler)


def skip_resumed_batches(trainer: Trainer | None, dataloader: object, batches: int, epoch: int = 0) -> bool:
    """Make the training ``dataloader``'s next pass start ``batches`` batches in; False when it cannot be done.

    Only the training loader of a fit counts (the evaluation loaders are prepared later, or while
    sanity checking); the caller forgets the skip once this has returned True.
    """
    if batches <= 0 or trainer is None or trainer.state.stage != RunningStage.TRAINING or trainer.sanity_checking:
        return False
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    plain = type(batch_sampler) is BatchSampler and not isinstance(
        getattr(dataloader, "dataset", None), IterableDataset
    )
    if not isinstance(dataloader, DataLoader) or not plain:
        rank_zero_warn(
            f"Resuming inside an epoch: HorovodStrategy skips the {batches} batches already trained only for a "
            f"DataLoader over a map-style dataset with a batch size and a plain batch sampler (this is a "
            f"{type(dataloader).__name__}); this epoch restarts from its first batch."
        )
        return True
    assert isinstance(batch_sampler, BatchSampler)
    batch_sampler.sampler = _SkipFirst(batch_sampler, batches * batch_sampler.batch_size, epoch)
    # Lightning's advice for plain DataLoaders ("not resumable ... unreliable results") does not apply now.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    return True


class ResumePosition:
    """The strategy's part: record the position when saving, skip to it when the training loader is prepared."""

    def __init__(self) -> None:
        self.skip = 0
        self.epoch = 0

    def record(self, trainer: Trainer | None, checkpoint: dict[str, Any]) -> None:
        """While fitting (also from ModelCheckpoint in validation), the position inside the epoch."""
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            checkpoint[POSITION_KEY] = epoch_position(trainer)

    def restore(self, trainer: Trainer | None, checkpoint: dict[str, Any]) -> None:
        """Only a fit resumes training (validate/test/predict with a checkpoint leave nothing to skip)."""
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self.skip = batches_to_skip(checkpoint) if fitting else 0
        self.epoch = int(checkpoint.get(POSITION_KEY, {}).get("epoch", 0))

    def prepare(self, trainer: Trainer | None, dataloader: object) -> object:
        if skip_resumed_batches(trainer, dataloader, self.skip, self.epoch):
            self.skip = 0
        return dataloader
