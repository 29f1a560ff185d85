"""``shard="parameters"`` (ZeRO-3) on a job of two nodes of two workers, each a thread (``ThreadedJob``): the units
a policy picks, who owns a tied weight, and training that equals unsharded training bit for bit while each
worker holds only its slices of the units' parameters between computations.

Small integer inputs and weights in float64 and a power-of-two learning rate keep every sum exact in any order.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from hvd_plugins.core.comm.compression import NoCompression
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.sync.sharded import units as units_module
from hvd_plugins.core.sync.sharded.mode import ShardedGradientSync
from hvd_plugins.core.sync.sharded.units import find_units, outside_units, unit_owners
from hvd_plugins.pytorch.callbacks.memory import training_state_mb
from unit.integer_training import integer_inputs, integer_model, train_synced
from unit.threaded_horovod import RankHorovod, ThreadedJob

STEPS = 3
LR = 0.25


class Tied(nn.Module):
    """An embedding whose weight the head reuses, between two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight


def test_a_class_policy_picks_every_match_but_the_root_in_module_order() -> None:
    model = Tied()
    assert [name for name, _ in find_units(model, frozenset({nn.Linear}))] == ["blocks.0", "blocks.1", "head"]
    assert [name for name, _ in find_units(model, lambda m: isinstance(m, nn.Sequential))] == ["blocks"]
    assert find_units(nn.Linear(3, 3), frozenset({nn.Linear})) == []  # the model itself is never a unit


def test_without_a_policy_the_units_are_the_outermost_repeated_blocks() -> None:
    """The members of a ModuleList or Sequential of two or more modules of one class; their insides are theirs."""
    model = nn.Module()
    model.embed = nn.Embedding(5, 4)
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3))
    model.head = nn.Linear(4, 5)
    assert [name for name, _ in find_units(model, None)] == ["layers.0", "layers.1", "layers.2"]
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False)
    assert [name for name, _ in find_units(encoder, None)] == ["layers.0", "layers.1"]
    assert [name for name, _ in find_units(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), None)] == ["0", "1"]


def test_without_a_policy_a_model_that_repeats_nothing_is_its_own_unit() -> None:
    """Mixed classes, a single block, or repeated modules without parameters: no unit but the model's own."""
    assert find_units(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1)), None) == []
    assert find_units(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]), nn.Linear(2, 1)), None) == []
    assert find_units(nn.Sequential(nn.Sequential(nn.Tanh(), nn.Tanh()), nn.Linear(2, 1)), None) == []
    model = Tied()
    blocks = [module for _, module in find_units(model, None)]
    assert blocks == list(model.blocks)
    held, _ = outside_units(model, blocks)
    assert held == {id(model.embed.weight)}  # the head holds the same tensor


def test_without_a_policy_the_classes_a_model_declares_unsplittable_are_its_units() -> None:
    """Hugging Face's ``_no_split_modules``: the classes named there, wherever they sit."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attention(x, x, x)[0]

    model = nn.Module()
    model._no_split_modules = ["Layer"]
    model.first = Layer()
    model.rest = nn.ModuleDict({"second": Layer()})
    assert [name for name, _ in find_units(model, None)] == ["first", "rest.second"]


def test_a_policy_that_picks_a_container_never_called_picks_nothing_there() -> None:
    """A ModuleList's forward never runs, so no hook would gather it."""
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert find_units(model, lambda module: isinstance(module, nn.ModuleList)) == []
    assert [name for name, _ in find_units(model, frozenset({nn.Linear}))] == ["blocks.0", "blocks.1"]


def test_a_weight_tied_across_units_or_to_the_root_stays_with_no_unit() -> None:
    model = Tied()
    units = [module for _, module in find_units(model, frozenset({nn.Linear}))]
    owners = unit_owners(model, units)
    assert id(model.embed.weight) not in owners  # under the root and under the head
    assert owners[id(model.blocks[0].weight)] == 0 and owners[id(model.blocks[1].bias)] == 1


def test_what_no_unit_owns_is_the_models_own_unit_gathered_by_the_forward_of_its_modules() -> None:
    """The tied embedding, outside the blocks or tied into a unit, is sharded with the model's own unit, gathered
    when the embedding or a unit runs; what sits on the model itself or on a module never called stays whole."""
    model = Tied()
    model.scale = nn.Parameter(torch.ones(1))  # the model's forward may never run (a LightningModule's)
    model.extra = nn.ParameterList([nn.Parameter(torch.ones(2))])  # never called: no hook could gather it
    blocks = [module for _, module in find_units(model, frozenset({nn.Sequential}))]
    held, triggers = outside_units(model, blocks)
    assert held == {id(model.embed.weight)}
    assert triggers == [model.embed, model.head]
    linears = [module for _, module in find_units(model, frozenset({nn.Linear}))]
    assert outside_units(model, linears) == ({id(model.embed.weight)}, [model.embed, model.head])  # a unit too


def rank_data(rank: int, step: int) -> torch.Tensor:
    return integer_inputs(rank, step, rows=4, features=3, bound=2)


def unsharded(model: nn.Module, size: int) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(size):
            (model(rank_data(rank, step)).sum() / size).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep_until_backward"])
def test_sharded_parameters_train_as_unsharded_and_only_slices_stay_between_steps(
    monkeypatch: pytest.MonkeyPatch, reshard_after_forward: bool
) -> None:
    job = ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)
    model = integer_model(3, 5, 4, 2)
    expected = unsharded(model, job.size)

    def train(hvd: RankHorovod) -> dict[str, object]:
        mine = copy.deepcopy(model)
        sync = ShardedGradientSync(
            "parameters",
            NoCompression(),
            "average",
            CommCounters(),
            bucket_bytes=64,
            auto_wrap_policy=frozenset({nn.Linear}),
            reshard_after_forward=reshard_after_forward,
        )
        optimizer = sync.wrap(torch.optim.SGD(mine.parameters(), lr=LR, momentum=0.5), list(mine.named_parameters()))
        sync.setup(mine, [optimizer], None)
        held = []
        for step in range(STEPS):
            optimizer.zero_grad()
            sync.before_backward(optimizer)
            mine(rank_data(hvd.rank(), step)).sum().backward()
            sync.synchronize(optimizer)
            optimizer.step()
            held.append(sum(p.numel() for p in mine.parameters()))
        state = sync.model_state_dict(mine)
        between = sum(p.numel() for p in mine.parameters())
        monitored = training_state_mb(mine, [optimizer])["parameters_mb"] * 2**20  # what PeakMemoryMonitor shows
        assert monitored == sum(piece.numel() * 8 for piece in optimizer.slices)  # float64 slices only
        sync.teardown([optimizer])
        return {
            "held": held + [between],
            "rank": hvd.rank(),
            "state": [state[name].clone() for name, _ in model.named_parameters()],
            "after_fit": [p.detach().clone() for p in mine.parameters()],
        }

    results = job.run(train)
    whole = sum(p.numel() for p in model.parameters())
    for found in results:
        assert len(set(found["held"])) == 1 and found["held"][0] < whole  # between steps: this worker's shards
    assert sum(found["held"][0] for found in results) == whole  # the shards make the model, once
    for found in results:
        if found["rank"] == 0:  # the worker that writes checkpoints gets the whole state, a unit at a time
            assert all(torch.equal(a, b) for a, b in zip(found["state"], expected, strict=True))
        else:  # the others hold no whole copy of the units' parameters: their shards only
            assert sum(tensor.numel() for tensor in found["state"]) < whole
        assert all(torch.equal(a, b) for a, b in zip(found["after_fit"], expected, strict=True))  # whole again


def test_a_loaded_state_reaches_the_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    job = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)
    model = integer_model(3, 5, 2)
    loaded = {name: torch.full_like(value, 2.0) for name, value in model.state_dict().items()}

    def load(hvd: RankHorovod) -> list[torch.Tensor]:
        mine = copy.deepcopy(model)
        sync = ShardedGradientSync(
            "parameters", NoCompression(), "average", CommCounters(), 64, auto_wrap_policy=frozenset({nn.Linear})
        )
        optimizer = sync.wrap(torch.optim.SGD(mine.parameters(), lr=LR), list(mine.named_parameters()))
        sync.setup(mine, [optimizer], None)
        sync.load_model_state_dict(mine, loaded)
        assert sum(p.numel() for p in mine.parameters()) < sum(p.numel() for p in model.parameters())  # shards
        assert all(bool((p == 2.0).all()) for p in mine.parameters())  # which hold the loaded values
        sync.teardown([optimizer])
        return [p.detach().clone() for p in mine.parameters()]

    for parameters in job.run(load):
        assert all(bool((p == 2.0).all()) for p in parameters)


def test_the_next_units_gather_starts_while_the_one_before_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the second step on, forward starts each unit's gather in the pre-hook of the unit before it, and
    backward starts it when the unit after it begins its backward: the gathers are prefetched."""
    from hvd_plugins.core.sync.sharded.units import Unit

    job = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)
    model = integer_model(3, 5, 4, 2)
    events: dict[int, list[tuple[str, int]]] = {}
    own_start, own_gather = Unit.start_gather, Unit.gather

    def start(unit: Unit, full: bool = False) -> None:
        if not unit.whole and unit._pending is None:
            events.setdefault(threading.get_ident(), []).append(("start", unit.index))
        own_start(unit, full)

    def gather(unit: Unit, full: bool = False) -> None:
        if not unit.whole:
            events.setdefault(threading.get_ident(), []).append(("gather", unit.index))
        own_gather(unit, full)

    monkeypatch.setattr(Unit, "start_gather", start)
    monkeypatch.setattr(Unit, "gather", gather)

    def train(hvd: RankHorovod) -> list[tuple[str, int]]:
        mine = copy.deepcopy(model)
        sync = ShardedGradientSync(
            "parameters", NoCompression(), "average", CommCounters(), 64, auto_wrap_policy=frozenset({nn.Linear})
        )
        optimizer = sync.wrap(torch.optim.SGD(mine.parameters(), lr=LR), list(mine.named_parameters()))
        sync.setup(mine, [optimizer], None)
        def forget(step: int) -> None:  # only the last step's events are kept
            events.pop(threading.get_ident(), None)

        train_synced(sync, optimizer, mine, lambda step: rank_data(hvd.rank(), step), 2, before_step=forget)
        sync.teardown([optimizer])
        return events[threading.get_ident()]

    units = len([m for m in model.modules() if isinstance(m, nn.Linear)])
    for found in job.run(train):  # the second step's events; a gather logs itself before it starts its own
        forward, backward = found[: 2 * units], found[2 * units :]
        assert forward[:2] == [("gather", 0), ("start", 0)], found  # the first unit: nothing ran before it
        for index in range(1, units):  # started by the unit before it, gathered at its own forward
            after = 2 if index == 1 else 1  # the first unit's gather also logged its own start
            assert forward.index(("start", index)) == forward.index(("gather", index - 1)) + after, found
            assert forward.index(("start", index)) < forward.index(("gather", index)), found
        for index in range(units - 1):  # backward runs the units in reverse: started by the one after
            assert backward.index(("start", index)) < backward.index(("gather", index)), found


def test_units_gathered_in_bfloat16_compute_there_and_step_their_float64_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``param_dtype=torch.bfloat16``: each unit computes with its slices rounded to bfloat16, gathered in half the
    bytes, while the slices stay float64 masters: equal to training whose forward and backward use a bfloat16 copy
    of float64 weights, the gradients summed in float64, as FSDP's mixed precision trains."""
    job = ThreadedJob(nodes=1, workers_per_node=2).install(monkeypatch)
    model = integer_model(3, 5, 4, 2)
    data = [[integer_inputs(rank, step, rows=4, features=3, bound=2) / 3 for rank in range(2)] for step in range(3)]
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.5)
    for step in range(3):
        gradients = []
        for rank in range(2):
            copied = copy.deepcopy(reference).bfloat16()
            copied(data[step][rank].bfloat16()).sum().backward()
            gradients.append([p.grad.double() for p in copied.parameters()])
        for parameter, (first, second) in zip(reference.parameters(), zip(*gradients, strict=True), strict=True):
            parameter.grad = (first + second) / 2
        optimizer.step()

    sent: dict[str, set[torch.dtype]] = {}  # by thread: each rank's gathers
    own_allgather = units_module.start_slices_gather

    def allgather(piece: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.setdefault(threading.current_thread().name, set()).add(piece.dtype)
        return own_allgather(piece, *args, **kwargs)

    monkeypatch.setattr(units_module, "start_slices_gather", allgather)

    def train(hvd: RankHorovod) -> dict[str, object]:
        mine, counters = copy.deepcopy(model), CommCounters()
        sync = ShardedGradientSync(
            "parameters", NoCompression(), "average", counters, 64, auto_wrap_policy=frozenset({nn.Linear}),
            param_dtype=torch.bfloat16,
        )  # fmt: skip
        optimizer = sync.wrap(torch.optim.SGD(mine.parameters(), lr=LR, momentum=0.5), list(mine.named_parameters()))
        sync.setup(mine, [optimizer], None)
        seen: set[torch.dtype] = set()
        sent[threading.current_thread().name] = set()  # from here: training's
        mine[0].register_forward_pre_hook(lambda module, args: seen.add(module.weight.dtype))  # after the gather
        train_synced(sync, optimizer, mine, lambda step: data[step][hvd.rank()].bfloat16(), 3)
        slices = {piece.dtype for piece in optimizer.slices}
        gathered = set(sent[threading.current_thread().name])  # the units' gathers while training: 2 bytes each
        state = sync.model_state_dict(mine)  # a checkpoint's values: the float64 slices, not their rounding
        sync.teardown([optimizer])
        return {
            "seen": seen,
            "slices": slices,
            "gathered": gathered,
            "state": [state[name].clone() for name, _ in model.named_parameters()] if hvd.rank() == 0 else None,
            "after_fit": [p.detach().clone() for p in mine.parameters()],
        }

    expected = [p.detach() for p in reference.parameters()]
    for found in job.run(train):
        assert found["seen"] == found["gathered"] == {torch.bfloat16} and found["slices"] == {torch.float64}
        assert all(p.dtype == torch.float64 for p in found["after_fit"])
        assert all(torch.equal(a, b) for a, b in zip(found["after_fit"], expected, strict=True))
        if found["state"] is not None:
            assert all(torch.equal(a, b) for a, b in zip(found["state"], expected, strict=True))
