"""What would flat, fp16, two-level and DASO gradient sync cost on clusters too big to run here?

An alpha-beta cost model of one training step: the emulated cluster has 2 nodes and CPUs; users
run 2-64 nodes of 8 GPUs. The model is fitted to the emulated sweep (``emulated_cluster.py --sweep``
writes ``docs/benchmarks/emulated_sweep.json``), checked against every row of it, and then used to
project step time and speedup over flat fp32 allreduce for clusters we cannot run.

The model. A step costs ``compute + sum over its collective legs of the exposed leg time``; a leg
(one collective) costs ``rounds x round_s + hops x latency_s + bytes / bandwidth`` of the link that
bounds it, where ``bytes`` is what crosses the busiest port of that link:

- ring allreduce of ``n`` bytes over ``p`` workers (Horovod's allreduce over every worker):
  ``2(p-1)`` hops, ``2(p-1)/p x n`` bytes; a ring visits each node once, so a flat ring over ``N``
  nodes x ``L`` workers puts ``2(p-1)/p x n`` (``p = N L``) through each node's link to the others;
- the package's partner collectives (``hvd_plugins.core.comm.partners``: alltoalls that send only to
  the partners): a reduce-scatter or allgather is one round of one hop, ``(p-1)/p x n`` bytes; a
  sum over a pair inside a node exchanges the tensors (one round, ``n`` bytes: a ring's), a pair
  across nodes relays them (two one-way rounds, the same bytes); a larger group reduce-scatters
  and allgathers (two rounds, a ring's bytes);
- flat (fp32 or fp16 on the wire): one ring allreduce of the gradients over all workers, plus a
  cost per gradient tensor (Horovod negotiates each one and copies it into and out of its fusion
  buffer; a Transformer hands it hundreds per step, the other legs send flat buckets);
- hierarchical: reduce-scatter inside the node, ``L`` parallel cross-node sums of a ``1/L`` shard
  (together ``2(N-1)/N x n`` through the node's link), allgather inside the node; with one worker
  per node it is exactly the flat allreduce;
- DASO warmup/cooldown: one flat allreduce of the gradients per step in the downcast type;
- DASO cycling: a gradient sum inside the node every step; every ``global_skips`` steps a
  cross-node sum of the parameters in the downcast type (sharded over the node's workers) plus an
  allgather of the shards inside the node, which may hide behind the ``batches_to_wait`` steps of
  compute before its result is needed; once per epoch a blocking sync of the parameters (downcast)
  and the optimizer state (float32, ``state_per_param`` values per parameter), sharded across nodes
  and gathered inside the node in the same way (a node's workers hold the same values).

Gradient legs may hide behind ``overlap_s`` of the backward pass (Horovod starts allreducing
gradients as they become ready). Steps to the target are taken as equal for every mode: the
sweep measures this (its accuracy and steps-to-target columns), the projection assumes it.

Calibration (per machine). Without overlap the model is linear in its unknowns: a compute time
per (model, topology), a round cost for cross-node and for in-node collectives, a cost per tensor
of the flat allreduce (a model's tensor count is what its flat runs handed Horovod), seconds per byte
inside a node, seconds per byte across nodes for each link rate, and seconds per float16 byte
(a CPU converts and sums float16 slowly; taken as 0 on GPUs). Each (run, DASO phase) of
the sweep gives one equation: its mean measured step time = the model's step time. They are
solved by non-negative least squares weighted by 1 / measured time (relative errors count), so
one machine's sweep gives that machine's constants; rerun the sweep to calibrate another. The
wire hop latencies are folded into the round costs (Horovod's negotiation of each round dwarfs
them). On a shaped link the first ``SHAPER_BURST_BYTES`` of a step leave at the line rate (the
shaper's bucket fills while the workers compute). Horovod's hook-driven flat allreduce runs while
backward computes: up to a share of the compute hides it, one share per model (how early its
gradients are ready), chosen from a grid by coordinate descent, each choice refitted until the hidden
time settles; the two-level legs and DASO's syncs start after backward and hide nothing.

    python benchmarks/scaling_model.py                       # fit docs/benchmarks/emulated_sweep*.json, check, project
    python benchmarks/scaling_model.py --records other.json  # another machine's sweep
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hvd_plugins.core.tables import format_table
from hvd_plugins.testing.netns_cluster import SHAPER_BURST_BYTES, UNSHAPED
from hvd_plugins.testing.reports import docs_dir, write_report

RESULTS_DIR = docs_dir(__file__)

FP32_BYTES, FP16_BYTES = 4, 2
INTER, INTRA = "inter", "intra"
STATE_PER_PARAM = {"transformer": 2.0}
"""Optimizer state per parameter of the sweeps' models where a record does not say: AdamW's two moments
for the Transformer; SGD with momentum (one value) for the MLPs and the ResNet."""
ROUNDS_FOR_FUSION_BYTES = 64 * 2**20
"""Flat allreduce: one round per this many bytes of fused gradients (a Horovod-like fusion buffer)."""


# ------------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class Link:
    latency_s: float
    """Per message hop."""
    bytes_per_s: float
    """Through one port: a node's link to the others (inter), a worker's link to its node (intra)."""


@dataclass(frozen=True)
class Cluster:
    nodes: int
    workers_per_node: int
    intra: Link
    inter: Link
    round_inter_s: float
    """Fixed cost of one collective round that spans nodes (framework negotiation, launch)."""
    round_intra_s: float
    """Fixed cost of one collective round inside a node."""
    fp16_s_per_byte: float = 0.0
    """Extra time per float16 byte on the wire: a CPU converts and sums float16 slowly (0 on GPUs)."""
    tensor_s: float = 0.0
    """Per tensor of a flat allreduce: Horovod negotiates every gradient on its own and copies it into
    and out of its fusion buffer, so a model of hundreds of small tensors pays this hundreds of times."""

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError(
                f"a cluster needs >= 1 node and >= 1 worker per node, got {self.nodes}x{self.workers_per_node}"
            )


@dataclass(frozen=True)
class Leg:
    """One collective: the link that bounds it, bytes through that link's busiest port, ring hops."""

    scope: str
    bytes: float
    hops: int
    rounds: int = 1
    per_step: float = 1.0
    """How many times per step (1 / global_skips for DASO's cross-node send)."""
    gradient: bool = True
    """A gradient leg may hide behind the backward pass (``Workload.overlap_s``)."""
    hideable_steps: int = 0
    """DASO's non-blocking send may hide behind this many steps of compute."""
    fp16: bool = False
    """Carried as float16 (see ``Cluster.fp16_s_per_byte``)."""
    tensors: float = 0.0
    """Gradient tensors Horovod handles one by one in this leg (``Cluster.tensor_s``): a flat allreduce's."""


@dataclass(frozen=True)
class DasoPlan:
    downcast_bytes: int = FP16_BYTES
    global_skips: float = 4.0
    """Mean steps between cross-node syncs while cycling."""
    batches_to_wait: int = 1
    steps_per_epoch: float = math.inf
    """One blocking sync per epoch."""
    state_per_param: float = 1.0
    """Optimizer state averaged by the blocking sync, in float32 values per parameter (SGD momentum 1, Adam 2)."""


@dataclass(frozen=True)
class Workload:
    name: str
    params: float
    compute_s: float
    overlap_s: float = 0.0
    """Part of the compute (backward) that gradient communication can run behind."""


MODES = ("allreduce/none", "allreduce/fp16", "hierarchical/none", "hierarchical/fp16", "daso/none", "daso/fp16")
PHASES = ("sync", "warmup", "cycling", "cooldown")


def ring_allreduce(scope: str, p: int, nbytes: float, **kw: Any) -> Leg:
    return Leg(scope, 2 * (p - 1) / p * nbytes, 2 * (p - 1), **kw)


def reduce_scatter(scope: str, p: int, nbytes: float, **kw: Any) -> Leg:
    return Leg(scope, (p - 1) / p * nbytes, p - 1, **kw)


allgather = reduce_scatter  # same bytes and hops, the other direction


def partner_scatter(scope: str, p: int, nbytes: float, **kw: Any) -> Leg:
    """A reduce-scatter or allgather as one alltoall among ``p`` partners: one round, one hop."""
    return Leg(scope, (p - 1) / p * nbytes, 1, **kw)


def partner_sum(scope: str, p: int, nbytes: float, relay: bool = False, **kw: Any) -> Leg:
    """A sum among ``p`` partners that are not every worker: for two, an exchange (one round, inside a
    node) or a relay (two one-way rounds, across nodes); for more, scatter + gather."""
    if p <= 2:
        return Leg(scope, (p - 1) * nbytes, 2 if relay else 1, rounds=2 if relay else 1, **kw)
    return Leg(scope, 2 * (p - 1) / p * nbytes, 2, rounds=2, **kw)


def _flat(cluster: Cluster, nbytes: float, fp16: bool = False, tensors: float = 0.0) -> list[Leg]:
    if cluster.workers == 1:
        return []
    scope = INTER if cluster.nodes > 1 else INTRA
    rounds = max(1, math.ceil(nbytes / ROUNDS_FOR_FUSION_BYTES))
    return [ring_allreduce(scope, cluster.workers, nbytes, rounds=rounds, fp16=fp16, tensors=tensors)]


def _hierarchical(cluster: Cluster, nbytes: float, cross_bytes: float, tensors: float = 0.0) -> list[Leg]:
    n, local = cluster.nodes, cluster.workers_per_node
    fp16 = cross_bytes < nbytes
    if local == 1 or n == 1:  # Horovod's own flat allreduce, gradient by gradient
        return _flat(cluster, cross_bytes, fp16, tensors) if n > 1 else _flat(cluster, nbytes, tensors=tensors)
    return [
        partner_scatter(INTRA, local, nbytes),
        # L relays of n/L bytes share the node's link: 2(N-1)/N x n
        partner_sum(INTER, n, cross_bytes, relay=True, fp16=fp16),
        partner_scatter(INTRA, local, nbytes),
    ]


def _shards_across_nodes(
    cluster: Cluster, nbytes: float, per_step: float, messages: int = 1, hide: int = 0, fp16: bool = False
) -> list[Leg]:
    """A sum over nodes of what a node's workers hold alike: each carries a shard across, the node gathers.

    With one worker per node the peers are every worker (Horovod's ring); otherwise a relay. Each of
    ``messages`` (one per wire type) takes its own rounds.
    """
    n, local = cluster.nodes, cluster.workers_per_node
    extra = {"per_step": per_step, "gradient": False, "hideable_steps": hide}
    legs = []
    if n > 1:
        if local == 1:
            cross = ring_allreduce(INTER, n, nbytes, fp16=fp16, **extra)
        else:
            cross = partner_sum(INTER, n, nbytes, relay=True, fp16=fp16, **extra)
        legs.append(replace(cross, rounds=cross.rounds * messages))
    if local > 1:  # the node's workers each carried a shard: gather the sums, in their wire types
        legs.append(partner_scatter(INTRA, local, nbytes, rounds=messages, **extra))
    return legs


def _daso_parameter_sync(cluster: Cluster, params: float, plan: DasoPlan, per_step: float, hide: int) -> list[Leg]:
    """The non-blocking cross-node send: a sum of the downcast shards, then an allgather inside the node."""
    fp16 = plan.downcast_bytes == FP16_BYTES
    return _shards_across_nodes(cluster, params * plan.downcast_bytes, per_step, hide=hide, fp16=fp16)


def _daso_blocking_sync(cluster: Cluster, params: float, plan: DasoPlan, per_step: float) -> list[Leg]:
    """Once per epoch: parameters (downcast) and optimizer state (float32) averaged across nodes.

    A node's workers hold the same values, so they are summed as a send is, one message per wire
    type; with one node there is nothing to average.
    """
    if cluster.nodes == 1:
        return []
    nbytes = params * plan.downcast_bytes + params * plan.state_per_param * FP32_BYTES
    messages = 1 if plan.downcast_bytes == FP32_BYTES else 2
    return _shards_across_nodes(cluster, nbytes, per_step, messages=messages)


def legs_of(
    mode: str, phase: str, cluster: Cluster, params: float, plan: DasoPlan | None = None, tensors: float = 0.0
) -> list[Leg]:
    """The collectives of one step of ``mode`` (``phase`` matters for DASO only); ``tensors``: the model's
    gradient tensors, which Horovod's flat allreduce handles one by one (the other legs send flat buckets)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not modelled; choose from {list(MODES)}")
    sync, compression = mode.split("/")
    wire = FP16_BYTES if compression == "fp16" else FP32_BYTES
    if sync == "allreduce":
        return _flat(cluster, params * wire, fp16=wire == FP16_BYTES, tensors=tensors)
    if sync == "hierarchical":
        return _hierarchical(cluster, params * FP32_BYTES, params * wire, tensors)
    plan = plan or DasoPlan(downcast_bytes=wire)
    if phase in ("warmup", "cooldown", "sync"):
        return _flat(cluster, params * plan.downcast_bytes, fp16=plan.downcast_bytes == FP16_BYTES)
    if phase != "cycling":
        raise ValueError(f"DASO phase {phase!r} is not one of {list(PHASES)}")
    node_sum = ring_allreduce if cluster.nodes == 1 else partner_sum  # one node: the node is every worker
    local_sum = node_sum(INTRA, cluster.workers_per_node, params * wire, fp16=wire == FP16_BYTES)
    local = [] if cluster.workers_per_node == 1 else [local_sum]
    blocking = 0.0 if math.isinf(plan.steps_per_epoch) else 1 / plan.steps_per_epoch
    sends = max(0.0, 1 / plan.global_skips - blocking)
    return (
        local
        + _daso_parameter_sync(cluster, params, plan, sends, hide=plan.batches_to_wait)
        + (_daso_blocking_sync(cluster, params, plan, blocking) if blocking and cluster.workers > 1 else [])
    )


def leg_seconds(leg: Leg, cluster: Cluster) -> float:
    link, round_s = (
        (cluster.inter, cluster.round_inter_s) if leg.scope == INTER else (cluster.intra, cluster.round_intra_s)
    )
    fp16 = leg.bytes * cluster.fp16_s_per_byte if leg.fp16 else 0.0
    per_tensor = leg.tensors * cluster.tensor_s
    return leg.rounds * round_s + leg.hops * link.latency_s + leg.bytes / link.bytes_per_s + fp16 + per_tensor


def step_seconds(legs: Sequence[Leg], cluster: Cluster, workload: Workload) -> float:
    """compute + exposed communication: gradient legs beyond the overlap, DASO sends beyond B steps of compute."""
    gradient = sum(leg_seconds(leg, cluster) * leg.per_step for leg in legs if leg.gradient)
    exposed = max(0.0, gradient - workload.overlap_s)
    for leg in legs:
        if not leg.gradient and leg.per_step > 0:
            hidden = leg.hideable_steps * workload.compute_s
            exposed += max(0.0, leg_seconds(leg, cluster) - hidden) * leg.per_step
    return workload.compute_s + exposed


def linear_terms(legs: Sequence[Leg]) -> dict[str, float]:
    """Coefficients of the model without overlap: rounds and bytes per step on each kind of link."""
    terms = {"rounds_inter": 0.0, "rounds_intra": 0.0, "bytes_inter": 0.0, "bytes_intra": 0.0, "bytes_fp16": 0.0}
    terms["tensors"] = 0.0
    for leg in legs:
        terms["tensors"] += leg.tensors * leg.per_step
        terms[f"rounds_{leg.scope}"] += leg.rounds * leg.per_step
        terms[f"bytes_{leg.scope}"] += leg.bytes * leg.per_step
        terms["bytes_fp16"] += leg.bytes * leg.per_step if leg.fp16 else 0.0
    return terms


# ------------------------------------------------------------------------------------------ calibration
@dataclass(frozen=True)
class Observation:
    """One (run, phase) of the sweep: what ran and its mean measured step time."""

    model: str
    topology: str
    link: str
    mode: str
    phase: str
    params: float
    syncs_per_step: float
    steps_per_epoch: float
    step_s: float
    flat_route: bool = False
    """A hierarchical run whose buckets took the flat allreduce (small buckets, or the route measured faster)."""
    cross_bytes_per_step: float | None = None
    """Bytes each worker handed to cross-node collectives per step (the run's counters; None: not recorded)."""
    tensors: float = 0.0
    """The model's gradient tensors (what its flat allreduce runs hand Horovod per step)."""
    state_per_param: float = 1.0
    """Optimizer state values per parameter that DASO's closing sync averages (``DasoPlan``)."""

    @property
    def nodes_and_local(self) -> tuple[int, int]:
        nodes, local = self.topology.split("x")
        return int(nodes), int(local)

    @property
    def priced_link(self) -> str:
        """The link whose cost per byte applies: the shaped one, unless its token bucket never runs dry.

        The emulated link is ``tc tbf``: ``SHAPER_BURST_BYTES`` pass at the line rate, and the
        bucket refills at the shaped rate. A step whose cross-node bytes (every worker of the node
        sends through its link) fit in the bucket and refill within the step never waits for the
        rate, so it pays what an unshaped link costs (the small model's 19 KB a step at 50 Mbit/s).
        """
        if self.link == UNSHAPED or self.cross_bytes_per_step is None:
            return self.link
        node_bytes = self.cross_bytes_per_step * self.nodes_and_local[1]
        refill_s = node_bytes / (float(self.link) * 1e6 / 8)
        return UNSHAPED if node_bytes <= SHAPER_BURST_BYTES and refill_s <= self.step_s else self.link

    @property
    def hook_driven(self) -> bool:
        """Gradients summed by Horovod's flat allreduce as backward produces them (not after it)."""
        return self.mode.startswith("allreduce") or self.flat_route

    def burst_credit_bytes(self, link_bytes_per_step: float) -> float:
        """Bytes of a step that the shaper's bucket lets through at the line rate, on a shaped link.

        Every byte takes a token and tokens arrive at the shaped rate, so over a step the link cannot
        carry more than the rate allows; but the bucket fills up (to ``SHAPER_BURST_BYTES``) while the
        workers compute, and that much of the next exchange leaves without waiting for the rate.
        """
        if self.priced_link == UNSHAPED:
            return 0.0
        return min(float(SHAPER_BURST_BYTES), link_bytes_per_step)

    @staticmethod
    def of(run: dict[str, Any], phase: str, stats: dict[str, Any], tensors: float = 0.0) -> Observation:
        """The observation of one phase of one run record of emulated_sweep.json."""
        return Observation(
            run["model"],
            run["topology"],
            str(run["link_mbit"]),
            run["mode"],
            phase,
            float(run["params"]),
            stats.get("syncs_per_step", 1.0),
            run["steps_per_epoch"],
            stats["step_s"],
            flat_route=run["mode"].startswith("hierarchical") and _crossed_whole_gradient(run, stats),
            cross_bytes_per_step=stats.get("cross_node_bytes_per_step"),
            tensors=tensors,
            state_per_param=float(run.get("state_per_param", STATE_PER_PARAM.get(run["model"], 1.0))),
        )


@dataclass
class Calibration:
    """Fitted constants of one machine; ``values`` by unknown name (see ``unknowns_of``)."""

    values: dict[str, float] = field(default_factory=dict)

    def cluster(self, topology: str, link: str) -> Cluster:
        nodes, local = (int(x) for x in topology.split("x"))
        per_byte_inter = self.values.get(f"s_per_byte_inter[{link}]", 0.0)
        per_byte_intra = self.values.get("s_per_byte_intra", 0.0)
        return Cluster(
            nodes,
            local,
            intra=Link(0.0, 1 / per_byte_intra if per_byte_intra > 0 else math.inf),
            inter=Link(0.0, 1 / per_byte_inter if per_byte_inter > 0 else math.inf),
            round_inter_s=self.values.get("round_inter_s", 0.0),
            round_intra_s=self.values.get("round_intra_s", 0.0),
            fp16_s_per_byte=self.values.get("s_per_fp16_byte", 0.0),
            tensor_s=self.values.get("s_per_tensor", 0.0),
        )

    def predict(self, obs: Observation) -> float:
        cluster = self.cluster(obs.topology, obs.priced_link)
        workload = Workload(obs.model, obs.params, self.values.get(f"compute_s[{obs.model},{obs.topology}]", 0.0))
        legs = _observed_legs(obs, cluster)
        burst = obs.burst_credit_bytes(linear_terms(legs)["bytes_inter"])
        linear = step_seconds(legs, cluster, workload) - burst / cluster.inter.bytes_per_s
        return linear - self.hidden_behind_backward(obs, linear)

    def hidden_behind_backward(self, obs: Observation, linear_step_s: float) -> float:
        """Communication of a hook-driven flat allreduce that runs while backward still computes.

        Horovod starts each gradient's allreduce from its backward hook, so up to ``overlap_share`` of
        the compute can hide it (a share per model: how early its gradients are ready); the two-level
        legs and DASO's syncs start after backward.
        """
        share = self.values.get(f"overlap_share[{obs.model}]", 0.0)
        if share <= 0 or not obs.hook_driven:
            return 0.0
        compute = self.values.get(f"compute_s[{obs.model},{obs.topology}]", 0.0)
        return min(max(0.0, linear_step_s - compute), share * compute)


def _crossed_whole_gradient(run: dict[str, Any], stats: dict[str, Any]) -> bool:
    """Whether each worker handed (nearly) its whole gradient to cross-node collectives: the flat route.

    The two-level legs hand ``1/L`` of it (L workers per node), compressed or not.
    """
    wire = FP16_BYTES if run["mode"].endswith("fp16") else FP32_BYTES
    crossed = stats.get("cross_node_bytes_per_step")
    return crossed is not None and crossed >= 0.75 * float(run["params"]) * wire


def _observed_legs(obs: Observation, cluster: Cluster) -> list[Leg]:
    if obs.flat_route:
        obs = replace(obs, mode=obs.mode.replace("hierarchical", "allreduce"), phase="sync", flat_route=False)
    wire = FP16_BYTES if obs.mode.endswith("fp16") else FP32_BYTES
    plan = DasoPlan(
        downcast_bytes=wire,
        global_skips=1 / obs.syncs_per_step if obs.syncs_per_step > 0 else math.inf,
        batches_to_wait=0,
        steps_per_epoch=obs.steps_per_epoch,
        state_per_param=obs.state_per_param,
    )
    return legs_of(obs.mode, obs.phase, cluster, obs.params, plan, obs.tensors)


def unknowns_of(obs: Observation) -> dict[str, float]:
    """The observation's row of the linear system: coefficient per unknown (compute counts once)."""
    unit = Cluster(*obs.nodes_and_local, intra=Link(0.0, 1.0), inter=Link(0.0, 1.0), round_inter_s=0, round_intra_s=0)
    terms = linear_terms(_observed_legs(obs, unit))
    return {
        f"compute_s[{obs.model},{obs.topology}]": 1.0,
        "round_inter_s": terms["rounds_inter"],
        "round_intra_s": terms["rounds_intra"],
        "s_per_byte_intra": terms["bytes_intra"],
        f"s_per_byte_inter[{obs.priced_link}]": terms["bytes_inter"] - obs.burst_credit_bytes(terms["bytes_inter"]),
        "s_per_fp16_byte": terms["bytes_fp16"],
        "s_per_tensor": terms["tensors"],
    }


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0 (Lawson-Hanson active set, small problems)."""
    n = a.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        gradient = a.T @ (b - a @ x)
        candidates = np.where(~free & (gradient > 1e-12 * max(1.0, np.abs(gradient).max())))[0]
        if candidates.size == 0:
            break
        free[candidates[np.argmax(gradient[candidates])]] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            blocking = free & (z <= 0)
            steps = x[blocking] / (x[blocking] - z[blocking])
            x = x + steps.min() * (z - x)
            free &= x > 1e-15
    return x


OVERLAP_SHARES = tuple(share / 10 for share in range(8))
"""Shares of compute tried for how much of a hook-driven allreduce backward hides (``overlap_share``)."""


def calibrate(observations: Sequence[Observation], overlap_shares: Sequence[float] = OVERLAP_SHARES) -> Calibration:
    """Fit every unknown the observations touch, weighting rows by 1 / measured step time.

    The model is linear but for the overlap of hook-driven allreduces with backward: for given
    overlap shares (one per model) the fit is repeated with the time they hid added back to the
    measured steps until it settles, and each model's share is chosen from ``overlap_shares`` by
    coordinate descent on the weighted error.
    """
    rows = [unknowns_of(obs) for obs in observations]
    names = sorted({name for row in rows for name, value in row.items() if value != 0})
    a = np.array([[row.get(name, 0.0) for name in names] for row in rows])
    measured = np.array([obs.step_s for obs in observations])
    weights = 1 / measured

    def fit(shares: dict[str, float]) -> tuple[float, Calibration]:
        calibration, hidden = Calibration(dict(shares)), np.zeros(len(observations))
        for _ in range(6):
            solution = nonnegative_least_squares(a * weights[:, None], (measured + hidden) * weights)
            calibration = Calibration(dict(zip(names, (float(v) for v in solution), strict=True)) | shares)
            linear = a @ solution
            hidden = np.array(
                [calibration.hidden_behind_backward(o, s) for o, s in zip(observations, linear, strict=True)]
            )
        predicted = np.array([calibration.predict(obs) for obs in observations])
        return float(np.sum(((predicted - measured) * weights) ** 2)), calibration

    models = sorted({obs.model for obs in observations if obs.hook_driven})
    shares = {f"overlap_share[{model}]": 0.0 for model in models}
    best = fit(shares)
    for _ in range(3):
        for key in shares:
            for share in overlap_shares:
                candidate = fit(shares | {key: share})
                if candidate[0] < best[0] - 1e-12:
                    best, shares = candidate, shares | {key: share}
    return best[1]


def merged_records(sweeps: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The runs of several sweeps as one record set (one machine's: the fit shares its link constants)."""
    return {"runs": [run for sweep in sweeps for run in sweep["runs"]]}


def tensor_counts(records: dict[str, Any]) -> dict[str, float]:
    """Gradient tensors per model: what each worker's flat allreduce handed Horovod per step (its counters)."""
    counts: dict[str, float] = {}
    for run in records["runs"]:
        stats = run["phases"].get("sync")
        if run["mode"].startswith("allreduce") and stats:
            calls = stats.get("cross_node_calls_per_step") or stats.get("node_local_calls_per_step") or 0.0
            counts[run["model"]] = max(counts.get(run["model"], 0.0), float(calls))
    return counts


def observations_from(records: dict[str, Any]) -> list[Observation]:
    """One observation per (run, phase) with at least 2 steps, from emulated_sweep.json."""
    found = []
    tensors = tensor_counts(records)
    for run in records["runs"]:
        for phase, stats in run["phases"].items():
            if stats["steps"] >= 2:
                found.append(Observation.of(run, phase, stats, tensors.get(run["model"], 0.0)))
    return found


def check_against_sweep(records: dict[str, Any], calibration: Calibration) -> tuple[str, float]:
    """Predicted vs measured mean step time and time to target per sweep row; returns the table and worst error."""
    rows, worst = [], 0.0
    tensors = tensor_counts(records)
    for run in records["runs"]:
        phases = {p: s for p, s in run["phases"].items() if s["steps"] > 0}
        if not phases:  # a run of a single step has no step time apart from its setup
            continue
        predicted = {}
        for phase, stats in phases.items():
            predicted[phase] = calibration.predict(Observation.of(run, phase, stats, tensors.get(run["model"], 0.0)))
        steps = sum(s["steps"] for s in phases.values())
        measured_step = sum(s["steps"] * s["step_s"] for s in phases.values()) / steps
        predicted_step = sum(s["steps"] * predicted[p] for p, s in phases.items()) / steps
        step_error = predicted_step / measured_step - 1
        cells = [
            run["model"],
            run["topology"],
            run["link_mbit"],
            run["mode"],
            f"{1000 * measured_step:.1f}",
            f"{1000 * predicted_step:.1f}",
            f"{100 * step_error:+.0f}%",
        ]
        if run["time_to_target_s"]:
            # The first step (setup, first collectives) is measured, not modelled; every later step is.
            predicted_ttt = run["first_step_s"] + sum(s["steps_to_target"] * predicted[p] for p, s in phases.items())
            ttt_error = predicted_ttt / run["time_to_target_s"] - 1
            cells += [f"{run['time_to_target_s']:.1f}", f"{predicted_ttt:.1f}", f"{100 * ttt_error:+.0f}%"]
            worst = max(worst, abs(ttt_error))
        else:
            cells += ["-", "-", "-"]
        worst = max(worst, abs(step_error))
        rows.append(cells)
    headers = ["model", "topo", "link", "mode", "step ms", "model ms", "error", "s to target", "model s", "error"]
    return format_table(headers, rows), worst


def describe(calibration: Calibration) -> str:
    lines = []
    for name, value in sorted(calibration.values.items()):
        if name.startswith("overlap_share"):
            lines.append(f"  {name:<40} {value:8.2f} of compute hides a hook-driven allreduce")
        elif name.startswith("s_per_byte"):
            rate = f"{8 / value / 1e6:,.4g} Mbit/s" if value > 0 else "not resolved (bytes too few to matter)"
            lines.append(f"  {name:<40} {value:.3e} s/byte = {rate}")
        else:
            lines.append(f"  {name:<40} {1000 * value:8.2f} ms")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ projection
GBIT = 1e9 / 8
NVLINK = Link(latency_s=2e-6, bytes_per_s=0.8 * 450e9)
"""H100 SXM NVLink 4: 450 GB/s per GPU and direction, 80 % of it reached by a ring."""
INTER_LATENCY_S = 5e-6
INTER_EFFICIENCY = 0.9
ROUND_S = 1e-3
"""Per collective round: Horovod's background loop negotiates each round, 1 ms cycle by default."""
RESNET50 = Workload("ResNet-50 (25.6 M)", 25.6e6, compute_s=0.05, overlap_s=0.05 * 2 / 3)
"""H100, per-GPU batch 128, mixed precision, ~2,500 images/s; backward (2/3 of compute) hides gradient legs."""
ONE_B = Workload("1 B parameters", 1e9, compute_s=0.25, overlap_s=0.25 * 2 / 3)
"""H100, per-GPU batch 8 x 2048 tokens: 6 x 1e9 x 16,384 FLOP at 400 TFLOP/s."""
PROJECTED_MODES = ("allreduce/none", "allreduce/fp16", "hierarchical/none", "daso/fp16")
DASO_FLAT_FRACTION = 0.1
"""Share of DASO's steps in warmup/cooldown (flat fp16), e.g. 4 + 4 of 90 epochs (the reference defaults)."""


def projected_cluster(nodes: int, gbit: float, workers_per_node: int = 8) -> Cluster:
    inter = Link(INTER_LATENCY_S, INTER_EFFICIENCY * gbit * GBIT)
    return Cluster(nodes, workers_per_node, NVLINK, inter, round_inter_s=ROUND_S, round_intra_s=ROUND_S)


def projected_step(mode: str, cluster: Cluster, workload: Workload, steps_per_epoch: float) -> float:
    """Mean step time; DASO mixes its flat fp16 warmup/cooldown steps with cycling steps (gs 4, B 1)."""
    if not mode.startswith("daso"):
        return step_seconds(legs_of(mode, "sync", cluster, workload.params), cluster, workload)
    plan = DasoPlan(FP16_BYTES, global_skips=4, batches_to_wait=1, steps_per_epoch=steps_per_epoch)
    flat = step_seconds(legs_of(mode, "warmup", cluster, workload.params, plan), cluster, workload)
    cycling = step_seconds(legs_of(mode, "cycling", cluster, workload.params, plan), cluster, workload)
    return DASO_FLAT_FRACTION * flat + (1 - DASO_FLAT_FRACTION) * cycling


def steps_per_epoch_of(workload: Workload, workers: int) -> float:
    """ImageNet (1.28 M images, batch 128 per GPU) for ResNet-50; 1,000 steps between epoch ends for the 1 B model."""
    return 1.28e6 / (128 * workers) if workload is RESNET50 else 1000.0


def projection(
    node_counts: Sequence[int] = (2, 4, 8, 16, 32, 64), gbits: Sequence[float] = (25, 100, 400)
) -> list[dict]:
    rows = []
    for workload in (RESNET50, ONE_B):
        for gbit in gbits:
            for nodes in node_counts:
                cluster = projected_cluster(nodes, gbit)
                spe = steps_per_epoch_of(workload, cluster.workers)
                steps = {mode: projected_step(mode, cluster, workload, spe) for mode in PROJECTED_MODES}
                for mode in PROJECTED_MODES:
                    rows.append(
                        {
                            "workload": workload.name,
                            "gbit": gbit,
                            "nodes": nodes,
                            "gpus": cluster.workers,
                            "mode": mode,
                            "step_s": steps[mode],
                            "speedup": steps["allreduce/none"] / steps[mode],
                            "efficiency": workload.compute_s / steps[mode],
                        }
                    )
    return rows


def projection_table(rows: list[dict]) -> str:
    """One line per (model, link, nodes): flat fp32's step time and efficiency, every other mode's speedup."""
    others = [mode for mode in PROJECTED_MODES if mode != "allreduce/none"]
    table = []
    for key in dict.fromkeys((r["workload"], r["gbit"], r["nodes"]) for r in rows):
        by_mode = {r["mode"]: r for r in rows if (r["workload"], r["gbit"], r["nodes"]) == key}
        flat = by_mode["allreduce/none"]
        table.append(
            [
                key[0],
                f"{key[1]:g}",
                key[2],
                flat["gpus"],
                f"{1000 * flat['step_s']:.1f}",
                f"{100 * flat['efficiency']:.0f}%",
            ]
            + [f"{by_mode[mode]['speedup']:.2f}x" for mode in others]
        )
    headers = ["model", "Gbit/s", "nodes", "GPUs", "flat fp32 step ms", "flat efficiency"] + [
        f"{m} speedup" for m in others
    ]
    return format_table(headers, table)


def anchors() -> str:
    """The published anchors next to what the model says for their setups."""
    resnet101 = Workload("ResNet-101", 44.5e6, compute_s=64 / 135)  # P100, batch 64, ~135 images/s
    pcie = Link(5e-6, 0.8 * 16e9)
    horovod = Cluster(128, 4, pcie, Link(INTER_LATENCY_S, INTER_EFFICIENCY * 25 * GBIT), ROUND_S, ROUND_S)
    legs = legs_of("allreduce/none", "sync", horovod, resnet101.params)
    no_overlap = resnet101.compute_s / step_seconds(legs, horovod, resnet101)
    with_overlap = resnet101.compute_s / step_seconds(
        legs, horovod, replace(resnet101, overlap_s=resnet101.compute_s * 2 / 3)
    )
    lines = [
        "Anchor 1, Horovod's published benchmark: 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE, ResNet-101 at batch 64 "
        "per GPU: ~90 % scaling efficiency.",
        f"  model (P100 at ~135 images/s, PCIe inside the server): {100 * no_overlap:.0f} % without overlap, "
        f"{100 * with_overlap:.0f} % when backward hides the allreduce; the published 90 % lies between.",
    ]
    best = {}
    for r in projection():
        if r["mode"] == "daso/fp16" and r["workload"] == RESNET50.name:
            best[r["gbit"]] = max(best.get(r["gbit"], 0.0), 1 - 1 / r["speedup"])
    lines += [
        "Anchor 2, the DASO paper: up to 34 % less training time than optimized data-parallel training.",
        "  model, ResNet-50 on 2-64 nodes x 8 GPUs, DASO fp16 against flat fp32 allreduce, largest saving per link: "
        + ", ".join(f"{g:g} Gbit/s {100 * s:.0f} %" for g, s in best.items()),
    ]
    return "\n".join(lines)


def plot_projection(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    figure, axes_list = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    styles = {25: ":", 100: "--", 400: "-"}
    colors = {"allreduce/fp16": "tab:blue", "hierarchical/none": "tab:orange", "daso/fp16": "tab:green"}
    for axes, workload in zip(axes_list[0], workloads, strict=True):
        for mode, color in colors.items():
            for gbit, style in styles.items():
                points = [
                    (r["nodes"], r["speedup"])
                    for r in rows
                    if (r["workload"], r["mode"], r["gbit"]) == (workload, mode, gbit)
                ]
                if points:
                    axes.plot(
                        *zip(*points, strict=True),
                        style,
                        color=color,
                        marker="o",
                        markersize=3,
                        label=f"{mode} {gbit:g} Gbit/s",
                    )
        axes.axhline(1.0, color="gray", linewidth=0.8)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("nodes (8 GPUs each, NVLink inside)")
        axes.set_ylabel("projected speedup of a step over flat fp32 allreduce")
        axes.set_title(workload)
        axes.legend(fontsize=7, ncol=1)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def assumptions() -> str:
    text = (
        f"Assumptions of the projection: nodes of 8 GPUs joined by NVLink ({NVLINK.bytes_per_s / 1e9:.0f} GB/s per GPU "
        f"reached by a ring, {NVLINK.latency_s * 1e6:.0f} us a hop); between nodes 25/100/400 Gbit/s per node (all "
        f"its NICs together), {100 * INTER_EFFICIENCY:.0f} % of it reached, {INTER_LATENCY_S * 1e6:.0f} us a hop; "
        f"{ROUND_S * 1e3:.0f} ms per collective round (Horovod's negotiation cycle); one round per "
        f"{ROUNDS_FOR_FUSION_BYTES // 2**20} MiB of fused gradients. ResNet-50: {RESNET50.params / 1e6:.1f} M "
        f"parameters, {RESNET50.compute_s * 1e3:.0f} ms of compute a step (H100, batch 128, mixed precision), "
        f"ImageNet epochs; 1 B model: {ONE_B.compute_s * 1e3:.0f} ms a step (8 x 2048 tokens at 400 TFLOP/s), a "
        f"blocking DASO sync every 1,000 steps. Backward (2/3 of compute) hides gradient legs; DASO cycles with "
        f"global_skips 4 and batches_to_wait 1 (its send hides behind one step of compute) and spends "
        f"{100 * DASO_FLAT_FRACTION:.0f} % of its steps in warmup/cooldown as a flat fp16 allreduce. Every mode needs "
        f"the same number of steps to the target (DASO's accuracy cost is not modelled: check it on your task). Ring "
        f"collectives, no congestion, no stragglers; efficiency = compute / step time."
    )
    return textwrap.fill(text, width=110)


# ------------------------------------------------------------------------------------------ command line
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--records",
        type=Path,
        nargs="+",
        help="the sweeps' records, fitted together (emulated_cluster.py --sweep writes them; default: every "
        "emulated_sweep*.json in docs/benchmarks, the MLPs' and the other models')",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="where scaling_calibration.txt and scaling_projection.{txt,png} go",
    )
    args = parser.parse_args(argv)
    paths = args.records or sorted(RESULTS_DIR.glob("emulated_sweep*.json"))
    missing = [str(path) for path in paths if not path.exists()]
    if missing or not paths:
        parser.error(
            f"--records {missing or paths} does not exist; run `python benchmarks/emulated_cluster.py --sweep` first"
        )
    sweeps = {path.name: json.loads(path.read_text()) for path in paths}
    records = merged_records(sweeps.values())
    observations = observations_from(records)
    calibration = calibrate(observations)
    check, worst = check_against_sweep(records, calibration)
    sources = "; ".join(
        name + (f" (measured {sweep['measured']['date']}: {sweep['measured']['command']})" if sweep.get("measured")
                     else "")
        for name, sweep in sweeps.items()
    )  # fmt: skip
    fitted = (
        f"Calibrated on {sources}: {len(observations)} (run, phase) step times, "
        f"{len(calibration.values)} unknowns (NNLS, weights 1 / step time)\n{describe(calibration)}"
    )
    calibration_text = (
        f"{fitted}\n\nPredicted against measured, per sweep row (time to target: first step measured, "
        f"every later step modelled)\n\n{check}\n\nworst error {100 * worst:.0f} % (target: within 25 %)"
    )
    rows = projection()
    projection_text = f"{assumptions()}\n\n{projection_table(rows)}\n\n{anchors()}"
    print(f"{calibration_text}\n\n{projection_text}")
    write_report(args.results_dir / "scaling_calibration.txt", calibration_text, __file__, argv, verb="computed")
    write_report(args.results_dir / "scaling_projection.txt", projection_text, __file__, argv, verb="computed")
    (args.results_dir / "scaling_projection.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot_projection(rows, args.results_dir / "scaling_projection.png")
    print(f"written: {args.results_dir}/scaling_calibration.txt, scaling_projection.{{txt,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
