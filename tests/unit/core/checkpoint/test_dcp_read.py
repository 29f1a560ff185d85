"""Reading a DCP checkpoint whole in one process, and optimizer state keyed by names made torch's own layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from hvd_plugins.core.checkpoint.dcp_read import (
    by_parameter_index,
    is_dcp_checkpoint,
    read_dcp,
    refuse_other_directory,
    restore,
)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}], lr=0.1
    )
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def saved(tmp_path: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    """One process's DCP checkpoint of a model and its AdamW, keyed by names as FSDP2 saves them."""
    model, optimizer = trained()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer), "epoch": 3}
    path = tmp_path / "checkpoint"
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path, model, optimizer


def test_a_checkpoint_directory_is_read_whole_and_its_optimizer_state_loads_into_a_fresh_adamw(
    tmp_path: Path,
) -> None:
    path, model, optimizer = saved(tmp_path)
    assert is_dcp_checkpoint(path) and not is_dcp_checkpoint(tmp_path)
    whole = read_dcp(path)
    assert whole["epoch"] == 3
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fresh_optimizer = torch.optim.AdamW(
        [{"params": fresh[0].parameters()}, {"params": fresh[2].parameters(), "lr": 0.0}], lr=0.0
    )
    left = restore(
        {"model": fresh, "optim": fresh_optimizer, "epoch": 0},
        whole,
        True,
        lambda module, state, strict: module.load_state_dict(state, strict=strict),
        lambda optimizer, state, module: optimizer.load_state_dict(by_parameter_index(state, optimizer, module)),
    )
    assert left == {}
    for mine, theirs in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    expected, found = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert [group["lr"] for group in found["param_groups"]] == [0.1, 0.5]
    for index, values in expected["state"].items():
        for key, value in values.items():
            assert torch.equal(found["state"][index][key], value), (index, key)


def test_state_by_index_stays_as_it_is() -> None:
    model, optimizer = trained()
    state = optimizer.state_dict()
    assert by_parameter_index(state, optimizer, model) == state


def test_other_parameters_and_group_counts_are_named() -> None:
    model, optimizer = trained()
    by_name = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["0.weight", "0.bias", "9.weight"]}]}
    with pytest.raises(ValueError, match="1 param groups, this optimizer 2"):
        by_parameter_index(by_name, optimizer, model)
    by_name["param_groups"].append({"lr": 0.5, "params": ["2.weight", "2.bias"]})
    with pytest.raises(ValueError, match=r"only in the checkpoint \['9.weight'\]"):
        by_parameter_index(by_name, optimizer, model)


def test_a_directory_that_is_no_checkpoint_and_a_missing_shard_file_say_so(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match=r"not a checkpoint.*\.metadata.*notes\.txt"):
        refuse_other_directory(tmp_path)
    path, _, _ = saved(tmp_path)
    gone = sorted(path.glob("*.distcp"))
    gone[0].unlink()
    with pytest.raises(ValueError, match=rf"lacks 1 of the {len(gone)} shard files .*{gone[0].name}"):
        read_dcp(path)


def test_strict_loading_names_what_the_checkpoint_lacks(tmp_path: Path) -> None:
    path, model, _ = saved(tmp_path)
    with pytest.raises(KeyError, match=r"\['scheduler'\]"):
        restore({"model": model, "scheduler": 1}, read_dcp(path), True, lambda m, s, strict: None, lambda o, s, m: None)
