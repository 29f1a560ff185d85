"""The elastic launcher owns a fit's attempts: after a reset it ends the fit, has the strategy forget the old
world, tells user code and runs the fit again from the commit. Horovod's loop and commits are stand-ins here."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from hvd_plugins.fabric.lightning_internals import names_the_commit
from hvd_plugins.pytorch import elastic
from hvd_plugins.pytorch.strategies.launchers import elastic as launcher_module
from hvd_plugins.pytorch.strategies.launchers.elastic import HorovodElasticLauncher


class FakeCommits:
    """One snapshot, as ``ElasticCommits`` keeps it."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None


class FakeTrainer:
    """What the launcher reaches of a Trainer."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events
        self.state = SimpleNamespace(fn=TrainerFn.FITTING)
        val_loop = SimpleNamespace(_combined_loader="old world's validation loader")
        self.fit_loop = SimpleNamespace(
            _combined_loader="old world's training loader", epoch_loop=SimpleNamespace(val_loop=val_loop)
        )
        self.lightning_module = torch.nn.Linear(2, 2)  # a model, with the reset hook a LightningModule may define
        self.lightning_module.on_elastic_reset = self._hook("module")  # type: ignore[assignment]
        self.callbacks = [SimpleNamespace(on_elastic_reset=self._hook("callback")), SimpleNamespace()]

    def _hook(self, owner: str) -> Callable[..., None]:
        return lambda trainer, module, old, new: self.events.append((owner, old, new))

    def _teardown(self) -> None:
        self.events.append("teardown")


@pytest.fixture
def job(fake_horovod: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A 4-worker job that shrinks to 2 after the first attempt committed and failed."""
    hvd = fake_horovod(elastic, launcher_module, size=4, rank=3)
    monkeypatch.setattr(elastic, "ElasticCommits", FakeCommits)

    def run_attempts(attempt: Callable[[], Any], commits: FakeCommits, on_reset: Callable[[], None], **_: Any) -> Any:
        attempt()
        commits.snapshot = {"global_step": 5}  # the first attempt committed, then a peer was lost
        hvd._size, hvd._rank = 2, 1
        on_reset()
        return attempt()

    monkeypatch.setattr(launcher_module, "run_attempts", run_attempts)
    return SimpleNamespace(hvd=hvd)


def test_a_reset_ends_the_fit_forgets_the_world_tells_user_code_and_resumes_from_the_commit(job) -> None:
    events: list[Any] = []
    trainer, fit_state = FakeTrainer(events), elastic.ElasticFit(commit_every_n_steps=5)
    launcher = HorovodElasticLauncher(fit_state, forget_world=lambda: events.append("forget_world"))
    paths: list[Any] = []

    def fit(model: Any, train_dataloaders: Any = None, ckpt_path: Any = None) -> str:
        paths.append(ckpt_path)
        return "fitted"

    assert launcher.launch(fit, "model", "data", trainer=trainer) == "fitted"
    assert paths[0] is None and names_the_commit(paths[1]), "the second attempt restores the commit"
    assert events == ["forget_world", "teardown", ("module", 4, 2), ("callback", 4, 2)]
    assert trainer.fit_loop._combined_loader is None
    assert trainer.fit_loop.epoch_loop.val_loop._combined_loader is None
    assert fit_state.resets == 1 and fit_state.world_size == 2
    assert fit_state.committed_step() == 5


def test_other_stages_run_once_as_they_are(job) -> None:
    trainer = FakeTrainer([])
    trainer.state.fn = TrainerFn.VALIDATING
    launcher = HorovodElasticLauncher(elastic.ElasticFit(5), forget_world=lambda: None)
    assert launcher.launch(lambda *args: args, "model", trainer=trainer) == ("model",)
    assert launcher.elastic.commits is None
