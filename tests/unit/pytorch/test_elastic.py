"""An elastic fit's state without a strategy: a commit keeps the checkpoint content with where the epoch stands,
and a restore in a smaller world gives it back with the learning rates and the loggers' folders followed."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from hvd_plugins.pytorch import elastic


class FakeCommits:
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None

    def commit(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot


def _trainer(version: Any) -> Any:
    return SimpleNamespace(loggers=[SimpleNamespace(version=version, _version=version)])


def test_a_commit_and_a_restore_in_a_smaller_world(fake_horovod: Callable[..., Any]) -> None:
    hvd = fake_horovod(elastic, size=4)
    fit = elastic.ElasticFit(commit_every_n_steps=5)
    fit.commits = FakeCommits()  # type: ignore[assignment]
    assert fit.start_attempt() is False, "no commit yet: the fit starts over"
    fit.cursor.begin_segment(0, batch_size=8, share=40)
    weights = torch.ones(2)
    content = {"state_dict": {"w": weights}, "optimizer_states": [{"param_groups": [{"lr": 0.4}]}], "global_step": 3}
    fit.commit(_trainer("version_0"), batch_idx=2, content=lambda: content)
    weights += 1  # training goes on: the commit holds a copy
    assert fit.commits.snapshot is not None
    assert fit.commits.snapshot["state_dict"]["w"].tolist() == [1.0, 1.0]
    assert fit.commits.snapshot[elastic.ELASTIC_KEY]["segments"] == [[4, 24]]
    assert len(fit.commit_seconds) == len(fit.copy_seconds) == 1

    hvd._size = 2
    assert fit.start_attempt() is True
    resumed = _trainer("version_1")
    checkpoint = fit.restore(resumed, scale_lr=True)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == 0.2, "4 workers' lr, for 2"
    assert resumed.loggers[0]._version == "version_0", "rank 0's log folder goes on"
    assert fit.cursor.continues(0) and fit.cursor.samples_before(0, batch_size=8) == 24
    assert fit.committed_step() == 3
