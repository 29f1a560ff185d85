"""HorovodConfig: settings that cannot work together are refused, naming them."""

from __future__ import annotations

import pytest

from hvd_plugins.core.config import HorovodConfig


def test_gradient_predivide_factor_and_adasum_are_refused_with_daso() -> None:
    with pytest.raises(ValueError, match="gradient_predivide_factor=2.0 works only with sync='allreduce'"):
        HorovodConfig(sync="daso", gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="op='adasum' works only with sync='allreduce'"):
        HorovodConfig(sync="daso", op="adasum")


def test_state_dict_type_is_fsdp_strategys_name_for_shard_checkpoint() -> None:
    assert HorovodConfig(shard="parameters", state_dict_type="sharded").shard_checkpoint == "dcp"
    assert HorovodConfig(state_dict_type="sharded").shard_checkpoint == "dcp"  # unsharded too: DCP splits the writes
    assert HorovodConfig(shard="gradients", state_dict_type="full").shard_checkpoint == "full"
    assert HorovodConfig(shard="optimizer", shard_checkpoint="parts").shard_checkpoint == "parts"
    with pytest.raises(ValueError, match=r"state_dict_type='full' and shard_checkpoint='parts' disagree"):
        HorovodConfig(shard="gradients", state_dict_type="full", shard_checkpoint="parts")
    with pytest.raises(ValueError, match=r"state_dict_type='sharded' and shard_checkpoint='parts' disagree"):
        HorovodConfig(shard="gradients", state_dict_type="sharded", shard_checkpoint="parts")
    with pytest.raises(ValueError, match=r"state_dict_type='local' is not supported; choose one of \['full'"):
        HorovodConfig(shard="gradients", state_dict_type="local")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shard_checkpoint='parts' works only with shard="):
        HorovodConfig(shard_checkpoint="parts")  # nothing is sharded to write in parts


def test_full_sharding_inside_the_node_is_accepted_and_daso_is_not() -> None:
    assert HorovodConfig(shard="parameters", sync="hierarchical").shards_parameters
    with pytest.raises(ValueError, match="does not work with sync='daso'"):
        HorovodConfig(shard="parameters", sync="daso")


def test_an_activation_checkpointing_policy_is_classes_or_a_function_named_alike_on_every_rank() -> None:
    import torch

    config = HorovodConfig(activation_checkpointing_policy={torch.nn.Linear})
    assert config.activation_checkpointing_policy == frozenset({torch.nn.Linear})
    assert config.fingerprint()["activation_checkpointing_policy"] == "torch.nn.modules.linear.Linear"
    with pytest.raises(ValueError, match=r"activation_checkpointing_policy=3 must be a set of module classes"):
        HorovodConfig(activation_checkpointing_policy=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("param_dtype", "precision", "on_gpu", "gathered"),
    [
        ("auto", "bf16-mixed", True, "bf16"),
        ("auto", "16-mixed", True, "fp16"),
        ("auto", "32-true", True, "full"),
        ("auto", "bf16-mixed", False, "full"),  # the CPU: autocast's float32 norms refuse half weights
        ("bf16", "32-true", False, "bf16"),
        ("full", "bf16-mixed", True, "full"),
    ],
)
def test_units_are_gathered_in_half_by_default_only_under_mixed_precision_on_gpus(
    param_dtype: str, precision: str, on_gpu: bool, gathered: str
) -> None:
    config = HorovodConfig(shard="parameters", param_dtype=param_dtype)  # type: ignore[arg-type]
    assert config.gather_dtype(precision, on_gpu) == gathered
