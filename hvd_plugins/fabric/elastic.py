"""Elastic training for a Fabric loop: commit its state in memory, go on in place when workers die or join.

A Fabric loop is the user's own code, so the helper owns what the Trainer's strategy owns there:
the epochs and the batches. ``ElasticLoop`` keeps the named modules, optimizers and schedulers
(anything with ``state_dict``) and plain values, and hands out the epochs and each epoch's batches;
after every ``commit_every_n_steps`` batches it commits all of it to host memory. When workers die
or hosts join, Horovod starts again and the loop function runs again from the commit, with the rest
of the epoch dealt over the new workers (``core.elastic.epoch_split``)::

    fabric = Fabric(strategy="horovod")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    loop = ElasticLoop(fabric, model=model, optimizer=optimizer)

    @loop.run
    def train(loop: ElasticLoop) -> None:
        for epoch in loop.epochs(10):
            for x, y in loop.batches(dataset, batch_size=32):
                ...  # forward, fabric.backward, optimizer.step(): one optimizer step per batch

Without an elastic launch the same script runs once, with no commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sized
from typing import Any, TypeVar

from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

from hvd_plugins.core.backend.elastic import ElasticCommits, elastic_launch
from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.config import DEFAULT_COMMIT_EVERY_N_STEPS, validate_commit_interval
from hvd_plugins.core.elastic.attempts import run_attempts
from hvd_plugins.core.elastic.cursor import EpochCursor
from hvd_plugins.core.elastic.epoch_split import ElasticDistributedSampler
from hvd_plugins.core.elastic.snapshot import host_copy
from hvd_plugins.fabric.strategies.horovod import HorovodStrategy

log = logging.getLogger(__name__)
T = TypeVar("T")
LOOP_KEY = "hvd_plugins_loop"


class ElasticLoop:
    """The epochs, batches and state of a Fabric loop that an elastic Horovod job commits and restores.

    Args:
        fabric: a launched ``Fabric(strategy="horovod")`` (flat allreduce: ``sync="allreduce"``).
        commit_every_n_steps: commit after this many batches (one optimizer step each).
        state: what a commit keeps, by name: objects with ``state_dict``/``load_state_dict`` (modules,
            optimizers, schedulers set up by Fabric) and plain values, read and set as attributes.
    """

    def __init__(self, fabric: Fabric, commit_every_n_steps: int = DEFAULT_COMMIT_EVERY_N_STEPS, **state: Any):
        strategy = fabric.strategy
        if not isinstance(strategy, HorovodStrategy):
            raise ValueError(f"ElasticLoop needs Fabric(strategy='horovod'), not {type(strategy).__name__}")
        if strategy.config.sync != "allreduce":
            raise ValueError(
                f"ElasticLoop works with sync='allreduce', not sync={strategy.config.sync!r}: the node layout of "
                "the two-level allreduce is fixed when Fabric sets up the optimizers"
            )
        if strategy.config.shard != "none":
            raise ValueError(
                f"ElasticLoop works with shard='none', not shard={strategy.config.shard!r}: Fabric lays out the "
                "optimizer's slices once, in fabric.setup, for the world of that moment. Sharded elastic training "
                "runs with the Trainer (Trainer(strategy=HorovodStrategy(shard=...)) under an elastic horovodrun)."
            )
        validate_commit_interval(commit_every_n_steps)
        self.fabric = fabric
        self.commit_every_n_steps = commit_every_n_steps
        self._stateful = {name: value for name, value in state.items() if hasattr(value, "state_dict")}
        self._plain = [name for name in state if name not in self._stateful]
        for name in self._plain:
            setattr(self, name, state[name])
        self.step = 0
        """Batches trained so far, over all epochs."""
        self.resets = 0
        self.commits: ElasticCommits | None = None
        self._cursor = EpochCursor()  # where the epoch under way stands, across resets

    @property
    def epoch(self) -> int:
        """The epoch under way (``epochs`` counts it)."""
        return self._cursor.epoch

    # ------------------------------------------------------------------ running
    def run(self, loop: Callable[[ElasticLoop], T]) -> Callable[[], T]:
        """Decorate the loop function: calling it runs the loop, elastically under an elastic launch."""

        def run_loop() -> T:
            if not elastic_launch():
                return loop(self)
            commits = self.commits = ElasticCommits()

            def attempt() -> T:
                if commits.snapshot is not None:
                    self._restore(commits.snapshot)
                return loop(self)

            return run_attempts(attempt, commits, self._after_reset, reset_number=lambda: self.resets + 1)

        return run_loop

    def _after_reset(self) -> None:
        hvd = horovod_torch()
        self.resets += 1
        strategy = self.fabric.strategy
        assert isinstance(strategy, HorovodStrategy)  # checked when the loop was made
        strategy.forget_world()
        log.info(
            f"elastic reset {self.resets}: {hvd.size()} workers; this worker is rank {hvd.rank()}; resuming from the "
            "last commit"
        )

    # ------------------------------------------------------------------ the loop
    def epochs(self, max_epochs: int) -> Iterator[int]:
        """The epochs from the one under way (after a reset: the committed one) up to ``max_epochs``."""
        while self.epoch < max_epochs:
            yield self.epoch
            self._cursor.next_epoch()

    def batches(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        **loader: Any,
    ) -> Iterator[Any]:
        """This worker's batches of the epoch under way, on Fabric's device; commits between them.

        ``DistributedSampler``'s split (``seed + epoch``), continued over the new workers after a resize.
        ``loader`` goes to the ``DataLoader`` (``num_workers``, ``collate_fn``...).
        """
        if not isinstance(dataset, Sized):
            raise ValueError(f"ElasticLoop.batches needs a dataset with a length, not {type(dataset).__name__}")
        size, rank, cursor = self.fabric.world_size, self.fabric.global_rank, self._cursor
        progress = cursor.progress() if cursor.continues(self.epoch) else None
        sampler = ElasticDistributedSampler(dataset, size, rank, shuffle, seed, drop_last, progress)
        sampler.set_epoch(self.epoch)
        batches = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader)
        cursor.begin_segment(self.epoch, batch_size, len(sampler))
        count = len(batches)
        for index, batch in enumerate(batches):
            yield self.fabric.to_device(batch)
            cursor.batches_done += 1
            self.step += 1
            if self.step % self.commit_every_n_steps == 0 and index + 1 < count:
                self.commit()

    def commit(self) -> None:
        """Commit the state and the position in the epoch (a no-op without an elastic launch)."""
        if self.commits is None:
            return
        snapshot = {name: value.state_dict() for name, value in self._stateful.items()}
        snapshot[LOOP_KEY] = {
            **self._cursor.commit_state(self.fabric.world_size),
            "step": self.step,
            "plain": {name: getattr(self, name) for name in self._plain},
        }
        self.commits.commit(host_copy(snapshot))

    def _restore(self, snapshot: dict[str, Any]) -> None:
        snapshot = host_copy(snapshot)  # the commit stays as it was
        for name, value in self._stateful.items():
            value.load_state_dict(snapshot[name])
        position = snapshot[LOOP_KEY]
        self._cursor.restore(position)
        self.step = int(position["step"])
        for name, value in position["plain"].items():
            setattr(self, name, value)
