"""Elastic commits: a host copy training does not change, learning rates rescaled for a new world size, and the
parts each worker keeps of its own."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.elastic.snapshot import give_own_parts, host_copy, rescale_learning_rates, take_own_parts
from hvd_plugins.core.sync.base import OWN_PARTS_KEY
from hvd_plugins.core.sync.sharded.replicas import commit_state


def test_a_commit_is_a_copy_that_training_does_not_change() -> None:
    weight = torch.ones(3)
    checkpoint = {"state_dict": {"w": weight}, "optimizer_states": [{"state": {0: {"step": torch.tensor(1.0)}}}]}
    copy = host_copy(checkpoint)
    weight.add_(1)
    assert torch.equal(copy["state_dict"]["w"], torch.ones(3))
    assert copy["optimizer_states"][0]["state"][0]["step"] is not checkpoint["optimizer_states"][0]["state"][0]["step"]


def test_learning_rates_in_a_checkpoint_are_rescaled() -> None:
    checkpoint = {
        "optimizer_states": [{"param_groups": [{"lr": 0.4, "initial_lr": 0.8, "params": [0]}]}],
        "lr_schedulers": [{"base_lrs": [0.8], "_last_lr": [0.4]}],
    }
    rescale_learning_rates(checkpoint, 0.5)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.2)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["initial_lr"] == pytest.approx(0.4)
    assert checkpoint["lr_schedulers"][0] == {"base_lrs": [0.4], "_last_lr": [0.2]}


def test_own_parts_stay_out_of_the_shared_snapshot_and_come_back_only_to_their_worker() -> None:
    parts = {3: torch.zeros(4, dtype=torch.uint8)}
    checkpoint = {"optimizer_states": [commit_state(parts, 4, [{"lr": 0.1}]), {"state": {}, "param_groups": []}]}
    taken = take_own_parts(checkpoint)
    assert taken == [parts, None]
    assert checkpoint["optimizer_states"][0][OWN_PARTS_KEY] is None  # the place stays, empty, in rank 0's snapshot
    give_own_parts(checkpoint, None)  # a worker that joined
    assert checkpoint["optimizer_states"][0][OWN_PARTS_KEY] == {}
    give_own_parts(checkpoint, taken)
    assert checkpoint["optimizer_states"][0][OWN_PARTS_KEY] == parts
    assert OWN_PARTS_KEY not in checkpoint["optimizer_states"][1]
