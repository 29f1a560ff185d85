"""The bucketed reducer on one rank, with an operation that doubles each bucket: when buckets start (backward's
hooks while armed, else at finish), results written back, accumulation, and reducers rebuilt on unfreezing."""

from __future__ import annotations

import copy

import torch
from torch import nn

from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.comm.in_flight import InFlight, Meanwhile
from hvd_plugins.core.comm.reducer import VIEW_ALONE_BYTES, BucketReducer, OptimizerReducers


class Doubling(InFlight[torch.Tensor | None]):
    """A bucket's operation of one round: twice the bucket, as it was when started (None with ``elsewhere``, as an
    operation that keeps its result itself returns)."""

    def __init__(self, flat: torch.Tensor, elsewhere: bool = False) -> None:
        self.flat = flat.clone()
        self.elsewhere = elsewhere
        self.progressed = 0

    def progress(self) -> None:
        self.progressed += 1

    def ready(self) -> bool:
        return True

    def wait(self, meanwhile: Meanwhile = None) -> torch.Tensor | None:
        return None if self.elsewhere else 2 * self.flat


class Operations:
    """The operation handed to the reducer, recording which buckets it started, by name, in order."""

    def __init__(self, elsewhere: bool = False) -> None:
        self.elsewhere = elsewhere
        self.started: dict[str, Doubling] = {}

    def __call__(self, index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor | None] | None:
        assert name.endswith(f".{index}")
        self.started[name] = Doubling(flat, self.elsewhere)
        return self.started[name]


def two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def backward(model: nn.Module, seed: int = 1) -> None:
    model(torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))).pow(2).sum().backward()


def gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_armed_buckets_start_from_backward_and_their_results_are_written_back_at_finish() -> None:
    model, operations = two_layers(), Operations()
    reducer = BucketReducer(list(model.parameters()), 1, operations, "grad")  # one bucket per tensor
    reducer.armed = True
    backward(model)
    assert sorted(operations.started) == ["grad.0", "grad.1", "grad.2", "grad.3"] and reducer.in_flight
    first = next(iter(operations.started.values()))
    assert first.progressed >= 4  # each bucket that started later moved it on
    doubled = [2 * g for g in gradients(model)]
    reducer.finish()
    assert all(torch.equal(got, want) for got, want in zip(gradients(model), doubled, strict=True))
    assert len(operations.started) == 4 and not reducer.in_flight  # finish started nothing more; next step
    backward(model)
    assert reducer.in_flight  # the next step's backward starts the buckets again


def test_unarmed_buckets_all_start_at_finish_in_bucket_order() -> None:
    model, operations = two_layers(), Operations()
    reducer = BucketReducer(list(model.parameters()), 1, operations, "grad")
    backward(model)
    assert operations.started == {} and not reducer.in_flight
    doubled = [2 * g for g in gradients(model)]
    reducer.finish()
    assert list(operations.started) == ["grad.0", "grad.1", "grad.2", "grad.3"]
    assert all(torch.equal(got, want) for got, want in zip(gradients(model), doubled, strict=True))
    assert reducer.bucket_nbytes() == [2 * 4, 4 * 2 * 4, 4 * 4, 3 * 4 * 4]  # the last layer's bias first


def test_accumulated_and_held_backward_passes_start_buckets_at_the_steps_last_pass() -> None:
    model, operations = two_layers(), Operations()
    reducer = BucketReducer(list(model.parameters()), 1, operations, "grad", passes=2)
    reducer.armed = True
    backward(model, seed=1)
    assert operations.started == {}
    backward(model, seed=2)
    assert len(operations.started) == 4  # at the second pass, on the sum of both
    accumulated = [2 * g for g in gradients(model)]
    reducer.finish()
    assert all(torch.equal(got, want) for got, want in zip(gradients(model), accumulated, strict=True))
    operations.started.clear()
    reducer.hold_next_backward()  # this step: 2 passes and one held
    for seed in (3, 4):
        backward(model, seed)
    assert operations.started == {}
    backward(model, seed=5)
    assert len(operations.started) == 4
    reducer.finish()
    reducer.set_backward_passes(1)
    operations.started.clear()
    backward(model)
    assert len(operations.started) == 4


def test_a_parameter_without_a_gradient_sends_zeros_and_no_operation_or_result_leaves_gradients_alone() -> None:
    model = two_layers()
    unused = nn.Parameter(torch.ones(3))
    operations = Operations()
    reducer = BucketReducer([*model.parameters(), unused], 1, operations, "grad")
    reducer.armed = True
    backward(model)
    assert len(operations.started) == 4  # the unused parameter's bucket waits for a gradient that never comes
    reducer.finish()
    assert unused.grad is not None and torch.equal(unused.grad, torch.zeros(3))
    untouched = two_layers()
    backward(untouched)
    before = gradients(untouched)
    idle = BucketReducer(list(untouched.parameters()), 1, lambda index, flat, name: None, "idle")
    idle.finish()
    kept_elsewhere = Operations(elsewhere=True)
    BucketReducer(list(untouched.parameters()), 1, kept_elsewhere, "elsewhere").finish()
    assert len(kept_elsewhere.started) == 4
    assert all(torch.equal(got, want) for got, want in zip(gradients(untouched), before, strict=True))


def test_optimizer_reducers_are_built_again_when_trainable_parameters_change_but_not_while_in_flight() -> None:
    model, operations = two_layers(), Operations()
    first_layer = list(model[0].parameters())
    for parameter in first_layer:
        parameter.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reducers = OptimizerReducers(1, operations)
    assert reducers.existing(optimizer) is None
    reducer = reducers.for_optimizer(optimizer, "grad.opt0", passes=1)
    assert reducers.for_optimizer(optimizer, "grad.opt0", passes=1) is reducer is reducers.existing(optimizer)
    assert reducer.matches(list(model[2].parameters()))
    reducer.armed = True
    backward(model)
    for parameter in first_layer:
        parameter.requires_grad_(True)  # unfrozen while the buckets' operations run
    assert reducers.for_optimizer(optimizer, "grad.opt0", passes=1) is reducer  # kept until they land
    reducer.finish()
    rebuilt = reducers.for_optimizer(optimizer, "grad.opt0", passes=1)
    assert rebuilt is not reducer and rebuilt.matches(list(model.parameters()))
    assert not reducer.armed  # the old reducer's hooks are gone
    operations.started.clear()
    rebuilt.armed = True
    backward(model)
    assert sorted(operations.started) == ["grad.opt0.0", "grad.opt0.1", "grad.opt0.2", "grad.opt0.3"]
    reducers.remove_all()
    assert reducers.existing(optimizer) is None


class DoublingInPlace(InFlight[torch.Tensor]):
    """An in-place operation: doubles the bucket where it lies and returns it."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat

    def progress(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def wait(self, meanwhile: Meanwhile = None) -> torch.Tensor:
        return self.flat.mul_(2)


def test_with_views_a_large_gradient_is_a_bucket_of_its_own_summed_where_it_lies() -> None:
    torch.manual_seed(0)
    side = int((VIEW_ALONE_BYTES // 4) ** 0.5)
    model = nn.Sequential(nn.Linear(side, side), nn.Tanh(), nn.Linear(side, 2))  # one weight of VIEW_ALONE_BYTES
    handed: list[torch.Tensor] = []

    def operation(index: int, flat: torch.Tensor, name: str) -> InFlight[torch.Tensor]:
        handed.append(flat)
        return DoublingInPlace(flat)

    reducer = BucketReducer(list(model.parameters()), 64 * VIEW_ALONE_BYTES, operation, "grad", alone=True)
    assert [len(bucket) for bucket in reducer.buckets.buckets] == [1, 3]  # the large weight alone, then the rest
    reducer.armed = True
    model(torch.randn(4, side)).sum().backward()
    first = model[0]
    assert isinstance(first, nn.Linear) and first.weight.grad is not None
    (alone,) = [flat for flat in handed if flat.numel() == first.weight.numel()]
    assert alone.data_ptr() == first.weight.grad.data_ptr()  # the gradient itself, not a copy
    (shared,) = [flat for flat in handed if flat is not alone]
    small = [p.grad for p in model.parameters() if p.grad is not None and p is not first.weight]
    assert all(is_inside(g, shared) for g in small)  # the others became views of their shared bucket
    reducer.finish()
    one_bucket = BucketReducer(list(model.parameters()), 64 * VIEW_ALONE_BYTES, Operations(), "grad")
    assert [len(bucket) for bucket in one_bucket.buckets.buckets] == [4]  # without alone: one bucket


def is_inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements lie inside ``flat``'s memory."""
    begin, size = flat.data_ptr(), flat.numel() * flat.element_size()
    return begin <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= begin + size


def test_gradients_become_views_of_their_bucket_and_backward_then_adds_into_it_with_no_copy() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    counters = CommCounters()
    reducer = BucketReducer(list(model.parameters()), 2**20, lambda i, f, n: DoublingInPlace(f), "g", counters=counters)
    batches = [torch.randn(5, 3, dtype=torch.float64) for _ in range(3)]
    reference = copy.deepcopy(model)
    reducer.armed = True
    for step, batch in enumerate(batches):
        reference.zero_grad(set_to_none=True)
        reference(batch).sum().backward()
        model.zero_grad(set_to_none=step != 1)  # None (as Lightning leaves them), or the views zeroed
        model(batch).sum().backward()
        reducer.finish()
        (flat,) = reducer._flats.values()
        assert all(is_inside(p.grad, flat) for p in model.parameters())
        for got, own in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got.grad, 2 * own.grad)  # summed where it lies, nothing copied back
    assert counters.copied_bytes == 0  # backward added into the bucket every step: lent before it accumulated
    replaced = model[0].weight
    reducer.armed = False  # the buckets start at finish: after the user's gradient is in place
    model(batches[0]).sum().backward()
    replaced.grad = torch.ones_like(replaced)  # a gradient the user put there: copied in once, then a view again
    reducer.finish()
    assert counters.copied_bytes == replaced.numel() * replaced.element_size() and is_inside(replaced.grad, flat)
    assert torch.equal(replaced.grad, torch.full_like(replaced, 2.0))


def test_a_sparse_gradient_adds_into_its_dense_view_and_one_set_sparse_is_a_counted_fallback() -> None:
    embedding = nn.Embedding(10, 3, sparse=True).double()
    head = nn.Linear(3, 1).double()
    parameters = [embedding.weight, *head.parameters()]
    counters = CommCounters()
    reducer = BucketReducer(parameters, 2**20, lambda i, f, n: DoublingInPlace(f), "g", counters=counters)
    tokens = torch.tensor([1, 2, 2])
    alone = copy.deepcopy(nn.Sequential(embedding, head))
    alone(tokens).sum().backward()
    dense = alone[0].weight.grad.to_dense()
    head(embedding(tokens)).sum().backward()
    reducer.finish()
    assert not embedding.weight.grad.is_sparse and torch.equal(embedding.weight.grad, 2 * dense)
    assert counters.view_fallbacks == 0 and counters.copied_bytes == 0
    embedding.weight.grad = dense.to_sparse()  # set sparse by hand: made dense, copied in, counted
    reducer.finish()
    assert counters.view_fallbacks == 1 and torch.equal(embedding.weight.grad, 2 * dense)
