"""Every strategy argument reaches its ``HorovodConfig`` field: the constructors map them one by one."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.sync.daso.config import DasoConfig
from hvd_plugins.fabric import HorovodStrategy as FabricHorovodStrategy
from hvd_plugins.pytorch import HorovodStrategy

LIGHTNING_PLUMBING = {"accelerator", "parallel_devices", "checkpoint_io", "precision_plugin", "precision"}
NOT_DEFAULT: dict[str, Any] = {
    "compression": "fp16",
    "op": "sum",
    "gradient_predivide_factor": 1.0,  # only with op="average"; checked on its own below
    "sparse_as_dense": True,
    "scale_lr": True,
    "sync": "hierarchical",
    "hierarchical_impl": "portable",
    "compress_node_local": True,
    "daso": None,
    "average_buffers": False,
    "bucket_mb": 4.0,
    "flat_below_mb": 0.5,
    "stall_timeout_seconds": 42,
    "check_finite_gradients": True,
    "auto_requeue": False,
    "cpu_threads": 3,
    "elastic": False,
    "commit_every_n_steps": 7,
    "activation_checkpointing_policy": frozenset({torch.nn.Linear}),
}
"""A value other than the default for every field that combines with the others (``shard`` needs the flat sync:
its own test below)."""
ALONE = {"shard", "shard_checkpoint", "state_dict_type", "async_save", "auto_wrap_policy", "reshard_after_forward"}
ALONE |= {"param_dtype"}


def _arguments(strategy: type) -> set[str]:
    return set(inspect.signature(strategy.__init__).parameters) - {"self"} - LIGHTNING_PLUMBING


def test_the_trainer_strategy_takes_exactly_the_config_fields() -> None:
    assert _arguments(HorovodStrategy) == set(HorovodConfig.argument_names())
    assert set(NOT_DEFAULT) | ALONE == set(HorovodConfig.argument_names())


def test_fabric_takes_the_fields_that_need_no_trainer() -> None:
    trainer_only = {"scale_lr", "daso", "average_buffers", "check_finite_gradients", "auto_requeue", "elastic"}
    trainer_only |= {"shard_checkpoint"}  # Fabric writes whole or DCP checkpoints (state_dict_type), not parts
    assert _arguments(FabricHorovodStrategy) == set(HorovodConfig.argument_names()) - trainer_only - {
        "commit_every_n_steps"
    }


@pytest.mark.parametrize("strategy", [HorovodStrategy, FabricHorovodStrategy], ids=["trainer", "fabric"])
def test_each_argument_lands_in_its_own_field(strategy: type) -> None:
    given = {name: value for name, value in NOT_DEFAULT.items() if name in _arguments(strategy)}
    config = strategy(**given).config
    stall = given.pop("stall_timeout_seconds")
    assert config.stall_timeout_seconds == float(stall)
    assert {name: getattr(config, name) for name in given} == given


def test_the_predivide_factor_and_daso_settings_reach_the_config() -> None:
    assert HorovodStrategy(gradient_predivide_factor=2.0).config.gradient_predivide_factor == 2.0
    daso = HorovodStrategy(sync="daso", daso={"warmup_epochs": 3}).config.daso
    assert isinstance(daso, DasoConfig) and daso.warmup_epochs == 3


@pytest.mark.parametrize("strategy", [HorovodStrategy, FabricHorovodStrategy], ids=["trainer", "fabric"])
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_shard_lands_in_its_field(strategy: type, shard: str) -> None:
    assert strategy(shard=shard).config.shard == shard


def test_shard_checkpoint_lands_in_its_field_and_needs_a_shard() -> None:
    assert HorovodStrategy(shard="gradients", shard_checkpoint="parts").config.shard_checkpoint == "parts"
    with pytest.raises(ValueError, match="shard_checkpoint='parts' works only with shard='optimizer', 'gradients'"):
        HorovodStrategy(shard_checkpoint="parts")


@pytest.mark.parametrize("strategy", [HorovodStrategy, FabricHorovodStrategy], ids=["trainer", "fabric"])
def test_the_unit_settings_land_in_their_fields_and_need_full_sharding(strategy: type) -> None:
    config = strategy(shard="parameters", auto_wrap_policy={torch.nn.Linear}, reshard_after_forward=False).config
    assert (config.auto_wrap_policy, config.reshard_after_forward) == (frozenset({torch.nn.Linear}), False)
    assert config.fingerprint()["auto_wrap_policy"] == "torch.nn.modules.linear.Linear"  # by name on every rank
    expected = r"auto_wrap_policy=\{torch.nn.modules.linear.Linear\} works only with shard='parameters', not shard="
    with pytest.raises(ValueError, match=expected):
        strategy(shard="gradients", auto_wrap_policy={torch.nn.Linear})
    with pytest.raises(ValueError, match="reshard_after_forward=False works only with shard='parameters'"):
        strategy(reshard_after_forward=False)
    assert strategy(shard="parameters", param_dtype=torch.bfloat16).config.param_dtype == "bf16"
    assert strategy(shard="parameters", param_dtype=None).config.param_dtype == "full"
    with pytest.raises(ValueError, match="param_dtype='bf16' works only with shard='parameters', not shard='gradi"):
        strategy(shard="gradients", param_dtype="bf16")
    with pytest.raises(ValueError, match=r"param_dtype=torch.float64 is not supported; choose one of \['auto'"):
        strategy(shard="parameters", param_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"auto_wrap_policy='Block' must be a set of module classes"):
        strategy(shard="parameters", auto_wrap_policy="Block")
