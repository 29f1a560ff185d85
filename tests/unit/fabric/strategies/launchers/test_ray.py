"""What Fabric's Ray launcher brings back to the driver, and what it refuses, without a Ray cluster."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from functools import partial

import torch

from hvd_plugins.fabric.strategies.launchers.ray import launches_nothing, to_cpu

Result = namedtuple("Result", ["loss", "extra"])


def test_results_come_back_detached_on_the_cpu_in_their_own_containers() -> None:
    weight = torch.ones(2, requires_grad=True)
    back = to_cpu(Result(weight * 2, OrderedDict(step=torch.tensor(3), name="run")))
    assert isinstance(back, Result) and isinstance(back.extra, OrderedDict)
    assert not back.loss.requires_grad and back.loss.device.type == "cpu" and back.extra["name"] == "run"


def test_a_launch_with_no_function_is_told_apart_from_one_with_a_function() -> None:
    def _do_nothing(*_: object) -> None:  # the name Fabric's launch() gives what it wraps when given nothing
        return None

    def train(fabric: object) -> int:
        return 1

    wrap = lambda function, *args: function(*args)  # noqa: E731  # stands for Fabric's _wrap_with_setup
    assert launches_nothing(partial(wrap, _do_nothing))
    assert not launches_nothing(partial(wrap, train)) and not launches_nothing(train)
