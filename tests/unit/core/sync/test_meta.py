"""A model built on the meta device, made real module by module: the values of the same model built whole from
the same seed, the same Parameter objects, units finished inner first, and a clear refusal where a module cannot
initialize its tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hvd_plugins.core.sync.meta import (
    check_materializable,
    has_meta_tensors,
    leave_placeholder,
    make_parameter_real,
    materialize,
    placeholders_to_meta,
    real_tensors,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 10)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _built(meta: bool) -> Tiny:
    torch.manual_seed(7)
    if not meta:
        return Tiny()
    with torch.device("meta"):
        model = Tiny()
    torch.manual_seed(7)  # the seed as it was before the whole model's initializers ran
    return model


pytestmark = pytest.mark.unit


def test_materialized_values_equal_the_model_built_whole_from_the_same_seed() -> None:
    whole = _built(meta=False)
    model = _built(meta=True)
    assert has_meta_tensors(model)
    materialize(model, torch.device("cpu"))
    assert not has_meta_tensors(model)
    for (name, expected), (_, got) in zip(whole.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(expected, got), name


def test_parameters_stay_the_objects_an_optimizer_holds() -> None:
    model = _built(meta=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = list(model.parameters())
    materialize(model, torch.device("cpu"))
    assert all(a is b for a, b in zip(before, model.parameters(), strict=True))
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], before, strict=True))
    model(torch.tensor([[1, 2, 3]]).reshape(3)).sum().backward()
    optimizer.step()  # the real tensors train


def test_a_unit_is_finished_once_everything_under_it_is_real_inner_first() -> None:
    model = _built(meta=True)
    units = [model.blocks[1], model.blocks[0], model.blocks[0].up]
    finished: list[int] = []

    def finish(index: int) -> None:
        assert not has_meta_tensors(units[index])
        finished.append(index)

    materialize(model, torch.device("cpu"), units, finish)
    assert finished == [2, 1, 0]


def test_a_module_without_reset_parameters_is_refused_by_name() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.register_buffer("mask", torch.tril(torch.ones(3, 3)))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scaled())
    with pytest.raises(ValueError, match=r"module '1' \(Scaled\) holds \['scale', 'mask'\].*reset_parameters"):
        check_materializable(model)
    with pytest.raises(ValueError, match="Scaled"):
        materialize(model, torch.device("cpu"))
    assert has_meta_tensors(model[0])  # refused before anything was made real


def test_real_tensors_leave_out_meta_and_freed_ones() -> None:
    real, freed, meta = torch.ones(2), torch.empty(0), torch.empty(2, device="meta")
    assert real_tensors([real, freed, meta]) == [real]


def test_a_placeholder_keeps_its_shape_and_parameter_and_becomes_meta_again() -> None:
    model = Tiny()
    weight = model.head.weight
    weight.note = "the user's"  # type: ignore[attr-defined]
    leave_placeholder(weight, weight.shape)
    assert weight.numel() == 0 and not has_meta_tensors(model)
    assert placeholders_to_meta(model)
    assert model.head.weight is weight, "the same Parameter: optimizers and hooks still hold it"
    assert weight.is_meta and weight.shape == (10, 6) and weight.requires_grad
    assert weight.note == "the user's"  # type: ignore[attr-defined]
    assert not placeholders_to_meta(model), "a placeholder turns into a meta tensor once"
    materialize(model, torch.device("cpu"))
    assert not has_meta_tensors(model) and model.head.weight.shape == (10, 6)


def test_a_parameter_made_real_keeps_the_hooks_registered_on_it_while_it_was_on_the_meta_device() -> None:
    """A sync registers its backward hooks on a model still on the meta device; made real a unit at a time, each
    parameter must keep calling them (else no bucket starts in backward and every gradient is held to the end)."""
    parameter = torch.nn.Parameter(torch.empty(3, device="meta"))
    accumulated: list[torch.Tensor] = []
    parameter.register_post_accumulate_grad_hook(lambda tensor: accumulated.append(tensor.grad))
    make_parameter_real(parameter, torch.device("cpu"))
    with torch.no_grad():
        parameter.fill_(1.0)
    (parameter * 2).sum().backward()
    assert len(accumulated) == 1 and torch.equal(accumulated[0], torch.full((3,), 2.0))


def test_placeholders_of_a_model_turn_back_into_its_shapes() -> None:
    """Units left after an elastic reset wait as empty placeholders that remember their shape."""
    model = torch.nn.Linear(3, 2)
    for parameter in model.parameters():
        leave_placeholder(parameter, parameter.shape)
    assert [tuple(p.shape) for p in model.parameters()] == [(0,), (0,)]
    assert not any(p.is_meta for p in model.parameters())
    assert placeholders_to_meta(model)
    assert [tuple(p.shape) for p in model.parameters()] == [(2, 3), (2,)] and all(p.is_meta for p in model.parameters())
