"""Each ZeRO stage is one object: the table of ``shard=`` names, and the norm ZeRO-2 clips by, combined from
slices over a job of two nodes of two workers (``ThreadedJob``)."""

from __future__ import annotations

import pytest
import torch

from hvd_plugins.core.sync.sharded.stages import (
    SHARD_STAGES,
    GradientStage,
    OptimizerStage,
    ParameterStage,
    global_norm,
)
from unit.threaded_horovod import RankHorovod, ThreadedJob

WHOLE = torch.arange(-11, 13, dtype=torch.float64) / 7
"""A gradient of 24 values, split into one slice of 6 per worker."""


def test_every_shard_name_is_one_stage_and_only_zero1_takes_the_slices_gradients_from_the_whole_ones() -> None:
    assert SHARD_STAGES == {"optimizer": OptimizerStage, "gradients": GradientStage, "parameters": ParameterStage}
    assert OptimizerStage.gradients_from_parameters and not GradientStage.gradients_from_parameters
    assert issubclass(ParameterStage, GradientStage)  # ZeRO-3's gradients travel as ZeRO-2's
    assert (OptimizerStage.land_early, GradientStage.land_early) == (False, True)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")])
def test_the_norm_from_slices_is_the_norm_of_the_whole_gradient(
    monkeypatch: pytest.MonkeyPatch, norm_type: float
) -> None:
    job = ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)

    def norm(hvd: RankHorovod) -> float:
        mine = WHOLE[6 * hvd.rank() : 6 * hvd.rank() + 6]
        return float(global_norm([mine[:2], mine[2:]], norm_type, workers=4))

    expected = float(torch.linalg.vector_norm(WHOLE, norm_type).float())
    assert job.run(norm) == pytest.approx([expected] * 4, rel=1e-6)


def test_a_slice_held_on_every_node_counts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharded inside the node: both nodes hold the same two slices, so each slice's powers arrive twice."""
    job = ThreadedJob(nodes=2, workers_per_node=2).install(monkeypatch)

    def norm(hvd: RankHorovod) -> float:
        half = WHOLE[12 * hvd.local_rank() : 12 * hvd.local_rank() + 12]
        return float(global_norm([half], 2.0, workers=4, copies=2))

    assert job.run(norm) == pytest.approx([float(torch.linalg.vector_norm(WHOLE))] * 4, rel=1e-6)
