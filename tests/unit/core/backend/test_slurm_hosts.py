"""An allocation's host list for horovodrun, from Slurm's variables."""

from __future__ import annotations

import pytest

from hvd_plugins.core.backend.slurm_hosts import horovodrun_hosts, tasks_per_node


def test_tasks_per_node_expands_slurms_repeat_counts() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="2x3"):
        tasks_per_node("2x3")


def test_horovodrun_hosts_outside_an_allocation_says_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="SLURM_TASKS_PER_NODE"):
        horovodrun_hosts({})
