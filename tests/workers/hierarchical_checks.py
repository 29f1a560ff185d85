"""Two-level allreduce and the node-aware strategy modes, on whatever topology horovodrun gives.

Run under ``-np 4 -H localhost:2,127.0.0.1:2`` (two emulated nodes) and ``-np 2`` (one node). After
these checks DASO's of two nodes of two workers (daso_checks.py) run in the same launch, and with
``--adasum`` (MPI only) Adasum's (adasum_checks.py) last; ``--case`` runs only the named ones.
The script starts Horovod itself with a plain ``hvd.init()``, as Horovod's docs do; the
node-aware syncs must keep that start (no restart, no process set beyond the global one).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import adasum_checks
import daso_checks
import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks, parse_out, write_result
from finetuning import UnfreezeExtra
from horovod.torch.mpi_ops import _basics
from models import (
    ManualAccumulation,
    TanhRegressor,
    TwoHeads,
    UnfrozenBehindTheStrategysBack,
    WideTanhRegressor,
    regression_data,
)
from strategy_common import all_equal, digest, max_difference, rank_loader, reference_sgd, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.core.comm import (
    CommCounters,
    FP16Compression,
    build_node_groups,
    discover_topology,
    hierarchical_allreduce_,
    partners,
    start_horovod_and_discover,
)
from hvd_plugins.core.sync.hierarchical import mode as hierarchical_sync
from hvd_plugins.pytorch import HorovodStrategy

checks = Checks()
"""In the order they run: ``check_still_one_process_set`` comes after every strategy trained."""


def rank_tensor(n: int, dtype: torch.dtype, integers: bool, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100 + hvd.rank())
    if integers:
        return torch.randint(-1000, 1000, (n,), generator=generator).to(dtype)
    return torch.randn(n, generator=generator, dtype=torch.float64).to(dtype)


@checks.register
def check_topology() -> dict[str, Any]:
    topology = discover_topology()
    return {
        "nodes": [list(node) for node in topology.nodes],
        "local_rank": topology.local_rank,
        "hvd_local_rank": hvd.local_rank(),
        "node_index": topology.node_index,
        "hvd_cross_rank": hvd.cross_rank(),
    }


@checks.register
def check_startup() -> dict[str, Any]:
    """After the script's own plain ``hvd.init()``: the layout is gathered, Horovod keeps running as it is."""
    before = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.cross_rank())
    start_horovod_and_discover(hvd)
    return {
        "same_ranks": before == (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.cross_rank()),
        "dynamic_env": os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS"),
        # Horovod's own table of the sets it runs (no public accessor in 0.28)
        "process_sets": sorted(sorted(ranks) for ranks in _basics._get_process_set_ids_and_ranks().values()),
    }


def check_still_one_process_set() -> dict[str, Any]:
    """After every node-aware strategy trained: the same Horovod, with its global process set only.

    Only the count is read: Horovod's per-set query can fail spuriously while its background
    thread is busy (its own docstring says so), the count cannot.
    """
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "process_sets": int(_basics.MPI_LIB_CTYPES.horovod_number_of_process_sets()),
    }


def compare_with_flat(
    dtype: torch.dtype, integers: bool, sizes: list[int], fp16: bool, flat_below_bytes: int = 0
) -> dict[str, Any]:
    groups = build_node_groups(start_horovod_and_discover(hvd))
    buffers = [rank_tensor(n, dtype, integers, seed=i) for i, n in enumerate(sizes)]
    flat = [hvd.allreduce(b.clone(), op=hvd.Average, name=f"flat.{dtype}.{i}.{fp16}") for i, b in enumerate(buffers)]
    counters = CommCounters()
    hierarchical_allreduce_(
        buffers,
        groups,
        average=True,
        compression=FP16Compression() if fp16 else None,
        counters=counters,
        flat_below_bytes=flat_below_bytes,
    )
    return {
        "max_abs_diff": max(float((h - f).abs().max()) for h, f in zip(buffers, flat, strict=True)),
        "max_abs_value": max(float(f.abs().max()) for f in flat),
        "exactly_equal": all(torch.equal(h, f) for h, f in zip(buffers, flat, strict=True)),
        "counters": counters.as_dict(),
        "elements": sum(sizes),
    }


@checks.register
def fp64_integers() -> dict[str, Any]:
    return compare_with_flat(torch.float64, True, [1, 7, 1000, 4096, 150_000], fp16=False)


@checks.register
def fp64_random() -> dict[str, Any]:
    return compare_with_flat(torch.float64, False, [13, 2049], fp16=False)


@checks.register
def fp32_random() -> dict[str, Any]:
    return compare_with_flat(torch.float32, False, [5, 100_001], fp16=False)


@checks.register
def fp32_fp16_wire() -> dict[str, Any]:
    return compare_with_flat(torch.float32, False, [999, 4096], fp16=True)


@checks.register
def fp32_mixed() -> dict[str, Any]:
    """1000 float32 (4000 B) under the 4001 B threshold go flat, 100_001 take the legs."""
    return compare_with_flat(torch.float32, False, [1000, 100_001], fp16=False, flat_below_bytes=4001)


@checks.register
def check_two_round_groups() -> dict[str, Any]:
    """Groups of two summing by reduce-scatter + allgather (the path of groups larger than two) equal flat."""
    exchange_max_size = partners.EXCHANGE_MAX_SIZE
    partners.EXCHANGE_MAX_SIZE = 1
    try:
        return compare_with_flat(torch.float64, True, [3, 1001, 200_001], fp16=False)
    finally:
        partners.EXCHANGE_MAX_SIZE = exchange_max_size


def fit(strategy: HorovodStrategy, accumulate: int = 1, wide: bool = False) -> tuple[TanhRegressor, pl.Trainer]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(128, 6, generator=generator, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    model = WideTanhRegressor() if wide else TanhRegressor()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        precision="64-true",
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    return model, trainer


def parameters_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


STRATEGY_MODES: dict[str, Any] = {}  # results of check_strategy_modes that later checks compare with


# TanhRegressor's gradient in buckets of at most MIXED_MB: [first weight: 96 float64 = 768 B] and [the rest:
# 33 float64 = 264 B]; with flat_below_mb=MIXED_MB the first takes the two-level legs, the second one flat allreduce.
MIXED_MB = 600 / 2**20
TWO_LEVEL = {"flat_below_mb": 0.0}  # every bucket takes the legs


@checks.register
def check_strategy_modes() -> dict[str, Any]:
    """sync='hierarchical' trains to the same weights as sync='allreduce', with counted bytes."""
    flat_model, flat_trainer = fit(HorovodStrategy(sync="allreduce"))
    default_model, default_trainer = fit(HorovodStrategy(sync="hierarchical"))  # small buckets: flat
    mixed_model, mixed_trainer = fit(HorovodStrategy(sync="hierarchical", bucket_mb=MIXED_MB, flat_below_mb=MIXED_MB))
    hier_model, hier_trainer = fit(HorovodStrategy(sync="hierarchical", **TWO_LEVEL))
    fp16_model, fp16_trainer = fit(HorovodStrategy(sync="hierarchical", compression="fp16", **TWO_LEVEL))
    flat_fp16_model, flat_fp16_trainer = fit(HorovodStrategy(compression="fp16"))
    accumulated_model, accumulated_trainer = fit(HorovodStrategy(sync="hierarchical", **TWO_LEVEL), accumulate=2)
    reference = parameters_of(flat_model)
    STRATEGY_MODES["flat"] = reference
    STRATEGY_MODES["hierarchical_fp16"] = (parameters_of(fp16_model), fp16_trainer.strategy.comm_counters.as_dict())
    gathered = hvd.allgather(parameters_of(hier_model).unsqueeze(0))
    return {
        "hier_vs_flat": float((parameters_of(hier_model) - reference).abs().max()),
        "default_vs_flat": float((parameters_of(default_model) - reference).abs().max()),
        "mixed_vs_flat": float((parameters_of(mixed_model) - reference).abs().max()),
        "default": default_trainer.strategy.comm_counters.as_dict(),
        "mixed": mixed_trainer.strategy.comm_counters.as_dict(),
        "hier_fp16_vs_flat": float((parameters_of(fp16_model) - reference).abs().max()),
        "flat_fp16_vs_flat": float((parameters_of(flat_fp16_model) - reference).abs().max()),
        "hier_ranks_identical": bool((gathered == gathered[0]).all()),
        "parameters": int(reference.numel()),
        "steps": hier_trainer.global_step,
        "accumulated_steps": accumulated_trainer.global_step,
        "flat": flat_trainer.strategy.comm_counters.as_dict(),
        "flat_fp16": flat_fp16_trainer.strategy.comm_counters.as_dict(),
        "hierarchical": hier_trainer.strategy.comm_counters.as_dict(),
        "hierarchical_fp16": fp16_trainer.strategy.comm_counters.as_dict(),
        "hierarchical_accumulated": accumulated_trainer.strategy.comm_counters.as_dict(),
        "local_size": hvd.local_size(),
        "cross_size": hvd.cross_size(),
    }


def check_route_tuning() -> dict[str, Any]:
    """flat_below_mb="auto" (the default) with a 1 MiB bucket: both routes timed, one choice everywhere."""
    flat_model, _ = fit(HorovodStrategy(sync="allreduce"), wide=True)
    tuned_model, trainer = fit(HorovodStrategy(sync="hierarchical"), wide=True)
    tuner = trainer.strategy.route_tuner
    choice = torch.tensor([0 if tuner is None or tuner.choice is None else 1 + (tuner.choice == "flat")])
    choices = hvd.allgather(choice, name="test.route_choice")
    return {
        "vs_flat": float((parameters_of(tuned_model) - parameters_of(flat_model)).abs().max()),
        "steps": trainer.global_step,
        "timed_steps": None if tuner is None else {route: len(times) for route, times in tuner.seconds.items()},
        "choices": choices.tolist(),
        "agreed_seconds": None if tuner is None else tuner.agreed_seconds,
    }


def check_compress_node_local() -> dict[str, Any]:
    """compress_node_local=True: fp16 on the node-local legs too; compared with the runs of strategy_modes."""
    strategy = HorovodStrategy(sync="hierarchical", compression="fp16", compress_node_local=True, **TWO_LEVEL)
    model, trainer = fit(strategy)
    params = parameters_of(model)
    fp16_params, fp16_counters = STRATEGY_MODES["hierarchical_fp16"]  # compress_node_local=False
    gathered = hvd.allgather(params.unsqueeze(0), name="test.compress_node_local")
    return {
        "vs_flat": float((params - STRATEGY_MODES["flat"]).abs().max()),
        "vs_uncompressed_node_local": float((params - fp16_params).abs().max()),
        "ranks_identical": bool((gathered == gathered[0]).all()),
        "parameters": int(params.numel()),
        "steps": trainer.global_step,
        "counters": trainer.strategy.comm_counters.as_dict(),
        "uncompressed_node_local_counters": fp16_counters,
    }


ONE_BUCKET_PER_TENSOR = {"bucket_mb": 1e-9, "flat_below_mb": 0.0}
"""Every gradient its own bucket, and every bucket over the two-level legs."""


def record_bucket_starts() -> tuple[list[bool], Any]:
    """Wrap the sync's bucket start: one entry per bucket started, whether backward was still running then."""
    starts: list[bool] = []
    original = hierarchical_sync.start_bucket_sum

    def recording(*args: Any, **kwargs: Any) -> Any:
        starts.append(torch._C._current_autograd_node() is not None)  # set while autograd runs a node
        return original(*args, **kwargs)

    hierarchical_sync.start_bucket_sum = recording
    return starts, original


@checks.register
def check_buckets_start_in_backward() -> dict[str, Any]:
    """Buckets start their legs from backward's hooks, and training still equals the flat allreduce's.

    One bucket per gradient tensor: with accumulation (the legs start on the last micro-batch only),
    with ``op="sum"``, with a second ``manual_backward`` before the step (DDP-style accumulation,
    op average and sum), with a layer unfrozen between epochs (both ways of unfreezing), and with one
    made trainable while backward's buckets ran without it.
    """
    result: dict[str, Any] = {}
    starts, original = record_bucket_starts()
    try:
        for accumulate in (1, 2):
            flat_model, _ = fit(HorovodStrategy(sync="allreduce"), accumulate=accumulate)
            starts.clear()
            model, trainer_ = fit(HorovodStrategy(sync="hierarchical", **ONE_BUCKET_PER_TENSOR), accumulate=accumulate)
            result[f"accumulate_{accumulate}"] = {
                "vs_flat": float((parameters_of(model) - parameters_of(flat_model)).abs().max()),
                "steps": trainer_.global_step,
                "started": len(starts),
                "started_in_backward": sum(starts),
                "tensors": len(list(model.parameters())),
            }
        world, micro, k = hvd.size(), 4, 2
        x, y = regression_data(64)
        for op, lr in (("average", 0.05), ("sum", 0.05 / world)):
            model = ManualAccumulation(k)
            model.lr = lr
            strategy = HorovodStrategy(sync="hierarchical", op=op, **ONE_BUCKET_PER_TENSOR)
            t = trainer(max_epochs=2, strategy=strategy, use_distributed_sampler=False)
            t.fit(model, rank_loader(x, y, micro))
            reference = reference_sgd(x, y, block=world * micro * k, epochs=2, lr=0.05, clip=None)
            result[f"manual_{op}"] = {
                "vs_large_batch": max_difference(model, reference),
                "ranks_identical": all_equal(digest(model)),
            }
        for name, new_group, accumulate in (("new_param_group", True, 1), ("in_place_accumulating", False, 2)):
            trained = {}
            for sync in ("allreduce", "hierarchical"):
                model = TwoHeads(extra_in_optimizer=not new_group)
                extras = ONE_BUCKET_PER_TENSOR if sync == "hierarchical" else {}
                t = trainer(
                    max_epochs=3,
                    strategy=HorovodStrategy(sync=sync, **extras),
                    accumulate_grad_batches=accumulate,
                    callbacks=[UnfreezeExtra(new_group)],
                )
                t.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
                trained[sync] = model
            result[f"unfrozen_{name}"] = {
                "vs_flat": max_difference(trained["hierarchical"], trained["allreduce"]),
                "ranks_identical": all_equal(digest(trained["hierarchical"])),
            }
        behind_its_back = {}  # buckets backward started without ``extra``: it is averaged after them
        for sync in ("allreduce", "hierarchical"):
            model = UnfrozenBehindTheStrategysBack()
            extras = ONE_BUCKET_PER_TENSOR if sync == "hierarchical" else {}
            t = trainer(max_epochs=1, strategy=HorovodStrategy(sync=sync, **extras))
            t.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
            behind_its_back[sync] = model
        result["unfrozen_behind_its_back"] = {
            "vs_flat": max_difference(behind_its_back["hierarchical"], behind_its_back["allreduce"]),
            "ranks_identical": all_equal(digest(behind_its_back["hierarchical"])),
            "extra_trained": not torch.equal(behind_its_back["hierarchical"].extra.weight, TwoHeads().extra.weight),
        }
    finally:
        hierarchical_sync.start_bucket_sum = original
    return result


checks.register(check_compress_node_local)  # after check_strategy_modes, whose runs it compares with
checks.register(check_route_tuning)
checks.register(check_still_one_process_set)  # after every node-aware strategy of the job trained

JOB = Checks(checks, daso_checks.two_by_two)
"""The two-node job's checks without Adasum's, in order."""

if __name__ == "__main__":
    OUT, ARGS = parse_out()
    hvd.init()
    job = Checks(JOB, *([adasum_checks.checks] if "--adasum" in sys.argv else []))
    write_result(OUT, hvd.rank(), job.selected(ARGS.case).run())
