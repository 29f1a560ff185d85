"""The model's placement, whole or sharded, chosen once from the config; each strategy step asks it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hvd_plugins.core import training_state
from hvd_plugins.core.backend import bfloat16
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.placement import ModelPlacement, ShardedPlacement, placement_for
from hvd_plugins.core.sync.meta import leave_placeholder


@pytest.mark.parametrize(("shard", "sharded"), [("none", False), ("optimizer", False), ("parameters", True)])
def test_only_sharded_parameters_place_the_model_as_shards(shard: str, sharded: bool) -> None:
    placement = placement_for(HorovodConfig(shard=shard))
    assert isinstance(placement, ShardedPlacement) is sharded
    assert placement.restores_after_setup is sharded
    assert placement.builds_on_meta(None) is sharded and placement.builds_on_meta(True) is sharded
    assert placement.builds_on_meta(False) is False  # empty_init=False asks for the whole model
    model = torch.nn.Linear(2, 3)
    assert placement.sharded_model(model) is (model if sharded else None)


def test_a_model_set_up_alone_is_sharded_with_grad_enabled_even_inside_inference_mode() -> None:
    seen: list[tuple[bool, bool]] = []

    def shard() -> None:
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    with torch.inference_mode():
        ModelPlacement().set_up_alone(shard)
        ShardedPlacement().set_up_alone(shard)
    assert seen == [(False, True)]  # whole: nothing to do; sharded: slices that can train later


def test_placeholders_take_their_shapes_again_before_optimizers_only_when_sharded() -> None:
    def with_placeholder() -> torch.nn.Linear:
        model = torch.nn.Linear(4, 3)
        leave_placeholder(model.weight, torch.Size([3, 4]))
        return model

    whole, sharded = with_placeholder(), with_placeholder()
    ModelPlacement().before_optimizers(whole)
    ShardedPlacement().before_optimizers(sharded)
    assert whole.weight.shape == (0,)
    assert sharded.weight.is_meta and sharded.weight.shape == (3, 4)


def test_a_whole_model_is_broadcast_at_setup_and_after_a_load_a_sharded_one_never(
    fake_horovod: Callable[..., object], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[list[torch.Tensor]] = []
    monkeypatch.setattr(training_state, "broadcast_from_root", lambda tensors, name: sent.append(list(tensors)))
    fake_horovod(training_state, bfloat16)
    model = torch.nn.Linear(2, 2)
    ModelPlacement().prepare(model, torch.device("cpu"))
    ModelPlacement().after_load(model)
    assert len(sent) == 2 and all(len(tensors) == 2 for tensors in sent)
    sent.clear()
    ShardedPlacement().prepare(model, torch.device("cpu"))
    ShardedPlacement().after_load(model)
    assert sent == []
