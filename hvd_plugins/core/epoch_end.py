"""What every rank does after its last training batch, so all ranks validate and save one model.

Ranks may hold different numbers of batches (a custom sampler, an IterableDataset). With the flat
allreduce, Horovod's ``join`` lets a rank that ran out of data wait while the others finish (its
gradients count as zeros meanwhile); afterwards the rank that ran longest hands its state to the
others. The node-aware syncs do not take part in that join (their collectives are not all allreduces),
so uneven batch counts are refused at the start of the epoch instead of hanging at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.naming import COLLECTIVE_NAMES
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.training_state import average_buffers_, broadcast_optimizer_state_

UNKNOWN_LENGTH = -1


class EpochEndPolicy:
    """Even-batch check at the epoch start; join, state resync and buffer averaging at its end.

    ``all_gather`` stacks a tensor from every rank (the strategy's own, so the collective is named).
    """

    def __init__(self, config: HorovodConfig, all_gather: Callable[[Tensor], Tensor]) -> None:
        self.config = config
        self.all_gather = all_gather

    def check_even_batches(self, num_training_batches: float, data_name: str = "the training data") -> None:
        """Refuse uneven batch counts for the node-aware syncs before any rank can hang.

        An unknown count is refused too: DASO's epoch ends with a blocking sync every rank must
        reach, and the hierarchical legs have no join, so a rank whose data runs out first would
        leave the others waiting.
        """
        if self.config.joins_uneven_data or horovod_torch().size() == 1:
            return
        known = UNKNOWN_LENGTH if num_training_batches == float("inf") else int(num_training_batches)
        counts = self.all_gather(torch.tensor([known], dtype=torch.int64)).flatten().tolist()
        if UNKNOWN_LENGTH in counts:
            raise ValueError(
                f"{self._setting()} needs to know how many training batches each rank has, but "
                f"{data_name} has no length on some rank (an IterableDataset without __len__). Give the dataset a "
                "__len__ equal on every rank, pass Trainer(limit_train_batches=<int>) with a count every rank "
                "reaches, or use sync='allreduce' with shard='none', which handles uneven data with Horovod's join."
            )
        if UNKNOWN_LENGTH not in counts and len(set(counts)) > 1:
            raise ValueError(
                f"{self._setting()} needs the same number of training batches on every rank, but ranks "
                f"have {dict(enumerate(counts))}. Use Lightning's DistributedSampler (the default), "
                "drop_last=True, or sync='allreduce' with shard='none', which handles uneven data with Horovod's join."
            )

    def _setting(self) -> str:
        """The setting that rules out Horovod's join, for the errors."""
        return f"shard={self.config.shard!r}" if self.config.shard != "none" else f"sync={self.config.sync!r}"

    def finish(self, model: Module | None, optimizers: Sequence[Optimizer], global_step: int) -> None:
        """Collective on every rank, after its own last training batch and before validation.

        With DASO the closing blocking sync already made parameters, optimizer state and buffers
        equal, so nothing is left to do here.
        """
        hvd = horovod_torch()
        if hvd.size() == 1 or self.config.sync == "daso":
            return
        if self.config.joins_uneven_data:
            last_rank = hvd.join()  # ranks that ran out of data wait here; nobody hangs
            COLLECTIVE_NAMES.resync()  # op counters may have drifted apart while ranks were uneven
            self._resync_after_uneven_epoch(model, optimizers, global_step, last_rank)
        if self.config.average_buffers and model is not None:
            average_buffers_(model, name=COLLECTIVE_NAMES.next("epoch_end_buffers"))

    def _resync_after_uneven_epoch(
        self, model: Module | None, optimizers: Sequence[Optimizer], global_step: int, last_rank: int
    ) -> None:
        """Joined ranks skipped the last updates: copy the state of the rank that ran longest."""
        steps = self.all_gather(torch.tensor([global_step], dtype=torch.int64))
        if bool((steps == steps[0]).all()) or model is None:
            return
        horovod_torch().broadcast_parameters(model.state_dict(), root_rank=last_rank)
        for index, optimizer in enumerate(optimizers):
            broadcast_optimizer_state_(optimizer, root_rank=last_rank, name=COLLECTIVE_NAMES.next(f"opt{index}"))
