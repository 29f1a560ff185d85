"""``HorovodRayStrategy`` on real local Ray clusters (``ray.cluster_utils.Cluster``), launched as users launch:
``python train.py`` (tests/workers/ray_fit.py); the same script under ``horovodrun`` is the reference."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hvd_launch import REPO, run_job, workers_for

from hvd_plugins.testing.launch import run_bounded

pytest.importorskip("ray", reason="Ray is not installed: pip install 'hvd_plugins[ray]' runs these tests")

COVERS = (
    "hvd_plugins.pytorch.strategies.ray",
    "hvd_plugins.pytorch.strategies.launchers.ray",
    "hvd_plugins.fabric.strategies.ray",
    "hvd_plugins.fabric.strategies.launchers.ray",
    "hvd_plugins.ray",
    "hvd_plugins.core.backend.ray_elastic",
)
SCRIPT = REPO / "tests" / "workers" / "ray_fit.py"


def driver(out: Path, *args: str, timeout: float = 240, lightning: str = "lightning.pytorch") -> dict[str, Any]:
    """``python ray_fit.py`` as a user runs it on a Ray cluster's head (with ``lightning``'s Trainer); what it
    wrote."""
    script = SCRIPT if lightning == "lightning.pytorch" else workers_for(lightning) / SCRIPT.name
    command = [sys.executable, str(script), "--out", str(out), *args]
    job = run_bounded(command, timeout, cwd=REPO, drop_launcher_env=True)
    assert not job.timed_out and job.returncode == 0, job.output[-6000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def fit_then_fabric(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One driver on two nodes: the Trainer's fit, then the same regression as a Fabric loop."""
    return driver(tmp_path_factory.mktemp("two_nodes"), "--cluster", "2", "--then-fabric")


def test_a_fit_on_two_ray_nodes_has_their_cross_ranks_and_the_weights_horovodrun_gives(
    fit_then_fabric: dict[str, Any], tmp_path: Path
) -> None:
    """4 actors SPREAD over a 2-node cluster: local size 2, cross size 2; the driver's model ends with the weights
    the same script gets under ``horovodrun -np 4 -H localhost:2,127.0.0.1:2``, and the driver's Trainer with rank
    0's metrics, state and best checkpoint."""
    on_ray = fit_then_fabric
    run_job(SCRIPT, "--launch", "horovodrun", "--out", str(tmp_path / "hvd"), np=4, hosts="localhost:2,127.0.0.1:2")
    reference = json.loads((tmp_path / "hvd" / "result.json").read_text())
    assert on_ray["metrics"]["hvd_cross_size"] == 2 and on_ray["metrics"]["hvd_local_size"] == 2, on_ray["metrics"]
    assert on_ray["weights"] == pytest.approx(reference["weights"], abs=1e-6)
    assert on_ray["metrics"] == pytest.approx(reference["metrics"], rel=1e-5)
    assert on_ray["state"] == "TrainerStatus.FINISHED"
    assert Path(on_ray["best_model_path"]).name == Path(reference["best_model_path"]).name
    assert Path(on_ray["best_model_path"]).exists()


def test_a_fabric_loop_launched_on_ray_returns_rank_zeros_result_as_one_large_batch_trains(
    fit_then_fabric: dict[str, Any],
) -> None:
    """``Fabric(strategy=HorovodRayStrategy(num_workers=4))`` and ``fabric.launch(train)`` on two Ray nodes: the
    driver gets rank 0's return value, whose weights are those of one process training on batches four times as
    large (each step averages the four workers' batches of 8: the next 32 samples in order)."""
    on_ray = fit_then_fabric["fabric"]
    assert (on_ray["rank"], on_ray["size"], on_ray["cross_size"]) == (0, 4, 2), on_ray
    assert on_ray["weights"] == pytest.approx(large_batch_weights(batch_size=32), abs=1e-5)


def large_batch_weights(batch_size: int) -> list[float]:
    """The Fabric loop of tests/workers/ray_fit.py in this one process, on batches of ``batch_size``."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True).sin()
    for start in range(0, 256, batch_size):
        torch.nn.functional.mse_loss(model(x[start : start + batch_size]), y[start : start + batch_size]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


@pytest.fixture(scope="module")
def refused_then_killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One driver on two nodes, under ``pytorch_lightning``'s Trainer (the fit above runs ``lightning.pytorch``'s):
    bad arguments first, then a fit whose worker of rank 2 is killed at its third step."""
    out = tmp_path_factory.mktemp("killed")
    return driver(out, "--cluster", "2", "--kill-rank", "2", "--refuse-first", lightning="pytorch_lightning")


def test_an_actor_killed_mid_fit_ends_the_fit_in_seconds_naming_its_rank_and_node(
    refused_then_killed: dict[str, Any],
) -> None:
    ended = refused_then_killed
    assert "rank 2 on Ray node" in ended["error"] and "every other worker was stopped" in ended["error"], ended
    assert ended["seconds"] < 60, ended


def test_an_elastic_sharded_fit_absorbs_a_node_that_leaves_and_one_that_joins_in_place(tmp_path: Path) -> None:
    """``HorovodRayStrategy(elastic=True, min_workers=2, max_workers=4, shard="parameters")`` on two Ray nodes of two
    workers each: the second node is removed after 6 steps, and a new node joins 6 steps later. Inside the one
    ``trainer.fit`` the workers go 4 -> 2 -> 4 (cross size 2 -> 1 -> 2), each world resuming from the last commit,
    and every worker of the last world ends with the same weights, which the driver's model then holds."""
    ended = driver(tmp_path, "--cluster", "2", "--case", "elastic", "--shard", "parameters")
    steps = [line.split() for line in ended["progress"].splitlines()]
    worlds = [(int(size), int(cross)) for step, size, cross, *_ in steps if step != "end"]
    assert [world for index, world in enumerate(worlds) if index == 0 or world != worlds[index - 1]] == [
        (4, 2),
        (2, 1),
        (4, 2),
    ], ended["progress"]
    first_of_two = next(index for index, (size, _) in enumerate(worlds) if size == 2)
    assert int(steps[first_of_two][0]) <= int(steps[first_of_two - 1][0]), "the 2 survivors resume from a commit"
    assert steps[-1][:2] == ["end", "4"] and float(steps[-1][2]) == 0.0, "the last world's weights differ"
    assert ended["state"] == "TrainerStatus.FINISHED" and ended["metrics"]["hvd_size"] == 4.0, ended
    assert len(ended["weights"]) == 129 and all(math.isfinite(weight) for weight in ended["weights"])


def test_bad_arguments_are_refused_before_any_worker_waits(refused_then_killed: dict[str, Any]) -> None:
    said = refused_then_killed["refused"]
    assert "num_workers=0" in said["no_workers"], said
    # on a CPU-only driver the Trainer trains on the CPU: the GPUs would be reserved and never used
    assert "use_gpu=True" in said["gpu"] and "accelerator='gpu'" in said["gpu"], said
    assert "num_workers=64" in said["too_many"] and "has 4" in said["too_many"], said
    assert "could not be placed (STRICT_SPREAD) within 2 s" in said["unplaceable"], said
    assert "placement='SPREAD'" in said["elastic_spread"] and "leave placement out" in said["elastic_spread"], said
    assert "num_workers=8 (the workers to start with)" in said["elastic_range"], said
    assert "num_workers=6 workers of {'CPU': 1.0} could not start within elastic_timeout_s=1" in said["elastic_waits"]
    assert "the live Ray nodes hold 4 such workers" in said["elastic_waits"], said
