"""The alpha-beta model of benchmarks/scaling_model.py: its algebra on cases computed by hand, its calibration,
and its reports against the ones in docs/benchmarks.

Pure arithmetic (numpy only): no workers are launched.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `benchmarks` is a package of the checkout, not of the installed project

from benchmarks import scaling_model as sm  # noqa: E402

DOCS = REPO / "docs" / "benchmarks"


def cluster(nodes: int, local: int, inter: float = 1.0, intra: float = 1.0, round_s: float = 0.0) -> sm.Cluster:
    return sm.Cluster(nodes, local, sm.Link(0.0, intra), sm.Link(0.0, inter), round_s, round_s)


def test_ring_allreduce_moves_two_p_minus_one_over_p_of_the_bytes() -> None:
    leg = sm.ring_allreduce(sm.INTER, 4, 1000.0)
    assert (leg.bytes, leg.hops) == (1500.0, 6)
    assert sm.reduce_scatter(sm.INTRA, 4, 1000.0).bytes == 750.0
    assert sm.allgather(sm.INTRA, 2, 1000.0).hops == 1


def test_flat_fp32_and_fp16_put_the_ring_bytes_on_the_node_link() -> None:
    # 2 nodes x 2 workers, 1,000 parameters: the ring of 4 sends 2*3/4 of the gradient bytes across.
    (fp32,) = sm.legs_of("allreduce/none", "sync", cluster(2, 2), 1000)
    (fp16,) = sm.legs_of("allreduce/fp16", "sync", cluster(2, 2), 1000)
    assert (fp32.scope, fp32.bytes, fp32.hops) == (sm.INTER, 6000.0, 6)
    assert fp16.bytes == 3000.0
    assert sm.legs_of("allreduce/none", "sync", cluster(1, 1), 1000) == []  # one worker: nothing to send


def test_hierarchical_legs_by_hand() -> None:
    legs = sm.legs_of("hierarchical/none", "sync", cluster(2, 2), 1000)
    assert [(leg.scope, leg.bytes) for leg in legs] == [(sm.INTRA, 2000.0), (sm.INTER, 4000.0), (sm.INTRA, 2000.0)]
    fp16 = sm.legs_of("hierarchical/fp16", "sync", cluster(2, 2), 1000)
    assert [leg.bytes for leg in fp16] == [2000.0, 2000.0, 2000.0]  # only the cross-node leg is compressed


@pytest.mark.parametrize("nodes", [2, 3, 8])
def test_hierarchical_equals_flat_with_one_worker_per_node(nodes: int) -> None:
    c = sm.Cluster(nodes, 1, sm.Link(1e-6, 1e9), sm.Link(5e-6, 1e8), 1e-3, 2e-3)
    work = sm.Workload("w", 1e6, compute_s=0.01)
    for compression in ("none", "fp16"):
        flat = sm.legs_of(f"allreduce/{compression}", "sync", c, 1e6)
        hierarchical = sm.legs_of(f"hierarchical/{compression}", "sync", c, 1e6)
        assert hierarchical == flat
        assert sm.step_seconds(hierarchical, c, work) == sm.step_seconds(flat, c, work)


def test_leg_time_is_rounds_plus_hops_plus_bytes_over_bandwidth() -> None:
    c = sm.Cluster(2, 1, sm.Link(1e-6, 1e9), sm.Link(1e-3, 1e6), round_inter_s=0.01, round_intra_s=0.0)
    leg = sm.Leg(sm.INTER, bytes=2e6, hops=2, rounds=3)
    assert sm.leg_seconds(leg, c) == pytest.approx(3 * 0.01 + 2 * 1e-3 + 2.0)


def test_daso_phases_by_hand() -> None:
    c = cluster(2, 2)
    # Warmup and cooldown: one flat allreduce of the gradients in the downcast type.
    assert sm.legs_of("daso/fp16", "warmup", c, 1000) == sm.legs_of("allreduce/fp16", "sync", c, 1000)
    # Cycling, global_skips 4, no epoch end: fp16 gradients inside the node every step (2*1/2*2000 bytes),
    # every 4th step a cross-node fp16 parameter sum relayed in two rounds (2*1/2*2000 bytes) and a gather
    # of the shards' fp16 sums (1/2*2000).
    plan = sm.DasoPlan(sm.FP16_BYTES, global_skips=4, batches_to_wait=0)
    terms = sm.linear_terms(sm.legs_of("daso/fp16", "cycling", c, 1000, plan))
    assert terms == {"rounds_inter": 0.5, "rounds_intra": 1.25, "bytes_inter": 500.0, "bytes_intra": 2250.0,
                     "bytes_fp16": 2500.0, "tensors": 0.0}  # fmt: skip
    # Horovod's flat allreduce handles the model's tensors one by one; DASO's flat warmup sends one bucket.
    assert sm.linear_terms(sm.legs_of("allreduce/none", "sync", c, 1000, tensors=260))["tensors"] == 260
    assert sm.linear_terms(sm.legs_of("daso/fp16", "warmup", c, 1000, tensors=260))["tensors"] == 0
    # One blocking sync per 8-step epoch replaces one of the two sends of that epoch. A node's workers hold
    # the same parameters and momentum, so each relays its half of them across, in two messages (fp16
    # parameters, fp32 momentum: 4 rounds), and the node gathers them (2 rounds): 2 x 1/8 relay + 4/8
    # blocking rounds across, 2000 + 4000 bytes through the node's link per blocking sync.
    plan = sm.DasoPlan(sm.FP16_BYTES, global_skips=4, batches_to_wait=0, steps_per_epoch=8)
    terms = sm.linear_terms(sm.legs_of("daso/fp16", "cycling", c, 1000, plan))
    assert terms["rounds_inter"] == pytest.approx(0.75)
    assert terms["bytes_inter"] == pytest.approx(2000 / 8 + 6000 / 8)


def test_a_shaped_link_whose_bucket_never_runs_dry_is_priced_as_unshaped() -> None:
    def observation(topology: str, link: str, cross_bytes: float, step_s: float) -> sm.Observation:
        return sm.Observation("m", topology, link, "allreduce/none", "sync", 1.0, 1.0, 16.0, step_s,
                              cross_bytes_per_step=cross_bytes)  # fmt: skip

    # 19 KB a step at 50 Mbit/s refill in 3 ms: within an 8 ms step and tbf's 256 KiB bucket.
    assert observation("2x1", "50", 19_200, 0.008).priced_link == "unshaped"
    # The same bytes from both workers of a node refill in 6 ms: still within a 16 ms step, not a 5 ms one.
    assert observation("2x2", "50", 19_200, 0.016).priced_link == "unshaped"
    assert observation("2x2", "50", 19_200, 0.005).priced_link == "50"
    # 3.2 MB a step is more than the bucket holds: the shaped rate applies however long the step.
    assert observation("2x1", "50", 3_172_392, 0.6).priced_link == "50"
    assert observation("2x1", "unshaped", 3_172_392, 0.02).priced_link == "unshaped"


def test_daso_send_hides_behind_batches_to_wait_steps_of_compute() -> None:
    c = cluster(2, 1, inter=1000.0)  # 2 nodes x 1: the send moves 2 bytes/param * 1000 = 2000 B in 2 s
    plan = sm.DasoPlan(sm.FP16_BYTES, global_skips=1, batches_to_wait=1)
    legs = sm.legs_of("daso/fp16", "cycling", c, 1000, plan)
    assert sm.step_seconds(legs, c, sm.Workload("w", 1000, compute_s=0.5)) == pytest.approx(0.5 + 1.5)
    assert sm.step_seconds(legs, c, sm.Workload("w", 1000, compute_s=3.0)) == pytest.approx(3.0)


def test_gradient_overlap_hides_only_up_to_the_backward_time() -> None:
    c = cluster(2, 1, inter=1000.0)
    legs = sm.legs_of("allreduce/none", "sync", c, 1000)  # 4000 bytes at 1000 B/s: 4 s
    assert sm.step_seconds(legs, c, sm.Workload("w", 1000, compute_s=1.0, overlap_s=0.5)) == pytest.approx(4.5)


def test_nonnegative_least_squares_clips_what_would_go_negative() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([2.0, -1.0, 1.0])
    x = sm.nonnegative_least_squares(a, b)
    assert x[1] == 0.0 and x[0] == pytest.approx(1.5)


def test_calibration_recovers_known_constants_from_synthetic_sweep_records() -> None:
    truth = sm.Calibration({
        "compute_s[large,2x1]": 0.020, "compute_s[large,2x2]": 0.035, "compute_s[small,2x2]": 0.004,
        "round_inter_s": 0.012, "round_intra_s": 0.006, "s_per_byte_intra": 1 / 2e9,
        "s_per_byte_inter[50]": 8 / 50e6, "s_per_byte_inter[200]": 8 / 200e6, "s_per_fp16_byte": 2e-9,
        "s_per_tensor": 3e-4,
    })  # fmt: skip
    observations = []
    tensors = {"large": 6.0, "small": 260.0}  # a few large tensors; hundreds of small ones
    for model, params in (("large", 8e5), ("small", 5e3)):
        for topology in ("2x1", "2x2") if model == "large" else ("2x2",):
            for link in ("50", "200"):
                for mode in ("allreduce/none", "allreduce/fp16", "hierarchical/none", "daso/fp16"):
                    for phase in ("warmup", "cycling") if mode.startswith("daso") else ("sync",):
                        syncs = 0.25 if phase == "cycling" else 1.0
                        obs = sm.Observation(model, topology, link, mode, phase, params, syncs, 16.0, 0.0,
                                             tensors=tensors[model])  # fmt: skip
                        observations.append(replace(obs, step_s=truth.predict(obs)))
    fitted = sm.calibrate(observations)
    shares = {name: fitted.values.pop(name) for name in list(fitted.values) if name.startswith("overlap_share")}
    assert shares == {"overlap_share[large]": 0.0, "overlap_share[small]": 0.0}  # nothing hidden in the truth
    assert set(fitted.values) == set(truth.values)
    for name, value in truth.values.items():
        assert fitted.values[name] == pytest.approx(value, rel=1e-6), name
    assert all(fitted.predict(o) == pytest.approx(o.step_s, rel=1e-9) for o in observations)


def test_projection_speedups_are_relative_to_flat_fp32() -> None:
    rows = sm.projection(node_counts=(2, 64), gbits=(25,))
    assert {r["speedup"] for r in rows if r["mode"] == "allreduce/none"} == {1.0}
    for r in rows:
        assert 0 < r["efficiency"] <= 1 and math.isfinite(r["step_s"])
    # fp16 halves the bytes: on a slow link it is faster than fp32, never slower.
    assert all(r["speedup"] > 1 for r in rows if r["mode"] == "allreduce/fp16")


def _body(path: Path) -> str:
    """A report without its two header lines (date, machine, command) and the blank line after them."""
    header, body = path.read_text().split("\n\n", 1)
    assert re.fullmatch(r"computed: \d{4}-\d\d-\d\d on .+\ncommand: python benchmarks/scaling_model\.py.*", header)
    return body


def test_the_script_refits_the_committed_sweep_and_reproduces_the_committed_projection(tmp_path: Path) -> None:
    """The reports in docs/benchmarks are what the script makes of the sweep there: a changed assumption
    without regenerated reports fails here (``python benchmarks/scaling_model.py`` regenerates them)."""
    assert sm.main(["--results-dir", str(tmp_path)]) == 0
    assert _body(tmp_path / "scaling_projection.txt") == _body(DOCS / "scaling_projection.txt")
    assert (tmp_path / "scaling_projection.json").read_text() == (DOCS / "scaling_projection.json").read_text()
    assert (tmp_path / "scaling_projection.png").stat().st_size > 0
    calibration = _body(tmp_path / "scaling_calibration.txt")
    committed = _body(DOCS / "scaling_calibration.txt")
    assert calibration.splitlines()[0] == committed.splitlines()[0]  # same records, run count and unknowns
    worst = re.findall(r"worst error (\d+) %", calibration + "\n" + committed)
    assert len(worst) == 2 and worst[0] == worst[1], worst
    sweeps = sorted(DOCS.glob("emulated_sweep*.json"))
    runs = sum(len(json.loads(path.read_text())["runs"]) for path in sweeps)
    models = tuple(f"{run['model']} " for path in sweeps for run in json.loads(path.read_text())["runs"])
    rows = [sum(line.lstrip().startswith(models) for line in t.splitlines()) for t in (calibration, committed)]
    assert rows == [runs, runs]  # one per run of every sweep fitted
