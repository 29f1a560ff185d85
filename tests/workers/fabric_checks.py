"""Fabric(strategy=HorovodStrategy(...)) in plain loops, each check against a single-process reference.

Every rank computes the reference itself (one process, the whole global batch, the same float64
model), so the checks compare what Horovod averaged with what one process would have computed.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import warnings
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
from _common import Checks, out_dir, parse_out, write_result
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.fabric import HorovodStrategy

checks = Checks()
BATCH = 8
RANK_ZERO_SEED = 10


def make_fabric(**strategy: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", strategy=HorovodStrategy(**strategy))  # float64 model and data
    fabric.launch()
    return fabric


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    return x, (x[:, :2].sum(1, keepdim=True) - x[:, 2:3]).tanh()


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def digest(module: nn.Module) -> str:
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in module.state_dict().values())).hexdigest()


def same_on_every_rank(value: str) -> bool:
    return len(set(hvd.allgather_object(value))) == 1


def rank_slice(x: torch.Tensor, step: int, per_rank: int) -> torch.Tensor:
    """The rows DistributedSampler(shuffle=False) gives this rank for global step ``step`` (rank r: r, r+N, ...)."""
    own = x[hvd.rank() :: hvd.size()]
    return own[step * per_rank : (step + 1) * per_rank]


def reference(steps: int, micro: int, clip: float | None = None) -> tuple[torch.Tensor, list[float]]:
    """One process, rank 0's initial model and SGD, each step over every rank's micro-batches at once."""
    model = net(RANK_ZERO_SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = data(steps * micro * BATCH * hvd.size())
    norms = []
    for step in range(steps):
        rows = slice(step * micro * BATCH * hvd.size(), (step + 1) * micro * BATCH * hvd.size())
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
    return flat(model), norms


def train(
    fabric: Fabric,
    steps: int,
    micro: int = 1,
    clip: float | None = None,
    start: int = 0,
    model=None,
    opt=None,
    hold: bool = True,
    lr: float = 0.05,
) -> dict[str, Any]:
    """The Fabric loop: ``micro`` micro-batches per step (under no_backward_sync with ``hold``), optional clipping."""
    if model is None:
        model = net(RANK_ZERO_SEED + hvd.rank())  # different on every rank until setup broadcasts rank 0's
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        model, opt = fabric.setup(model, opt)
    x, y = data((start + steps) * micro * BATCH * hvd.size())
    counters = fabric.strategy.comm_counters
    calls_before = counters.node_local_calls + counters.cross_node_calls
    norms = []
    for step in range(start, start + steps):
        for index in range(micro):
            rows = slice((step * micro + index) * BATCH * hvd.size(), (step * micro + index + 1) * BATCH * hvd.size())
            xs, ys = x[rows][hvd.rank() :: hvd.size()], y[rows][hvd.rank() :: hvd.size()]
            with fabric.no_backward_sync(model, enabled=hold and index < micro - 1):
                fabric.backward(nn.functional.mse_loss(model(xs), ys) / micro)
        if clip is not None:
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=clip)))
        opt.step()
        opt.zero_grad()
    calls = counters.node_local_calls + counters.cross_node_calls - calls_before
    return {"model": model, "opt": opt, "norms": norms, "allreduces_per_step": calls / steps}


@checks.register
def check_setup_broadcasts_rank_zeros_state() -> dict[str, Any]:
    fabric = make_fabric()
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(hvd.rank() + 1.0)
        model[1].running_mean.fill_(hvd.rank() + 5.0)
    model = fabric.setup(model)
    return {
        "same": same_on_every_rank(digest(model)),
        "weight": float(model.module[0].weight[0, 0]),
        "running_mean": float(model.module[1].running_mean[0]),
    }


@checks.register
def check_steps_equal_one_process_on_the_global_batch() -> dict[str, Any]:
    result = train(make_fabric(), steps=5)
    expected, _ = reference(steps=5, micro=1)
    return {
        "max_diff": float((flat(result["model"]) - expected).abs().max()),
        "same": same_on_every_rank(digest(result["model"])),
        "allreduces_per_step": result["allreduces_per_step"],
        "parameter_tensors": 4,
    }


@checks.register
def check_no_backward_sync_accumulates_with_one_allreduce_per_step() -> dict[str, Any]:
    result = train(make_fabric(), steps=3, micro=3)
    expected, _ = reference(steps=3, micro=3)
    return {
        "max_diff": float((flat(result["model"]) - expected).abs().max()),
        "allreduces_per_step": result["allreduces_per_step"],
        "same": same_on_every_rank(digest(result["model"])),
    }


@checks.register
def check_accumulating_without_no_backward_sync_equals_the_large_batch() -> dict[str, Any]:
    """Every backward allreduced, as a DDP loop without no_backward_sync does: op average and sum agree with
    one process (Horovod's hooks refuse a second backward before the step; the strategy settles the first)."""
    cases = {}
    for op, lr in (("average", 0.05), ("sum", 0.05 / hvd.size())):
        result = train(make_fabric(op=op), steps=3, micro=3, hold=False, lr=lr)
        expected, _ = reference(steps=3, micro=3)
        cases[op] = {
            "max_diff": float((flat(result["model"]) - expected).abs().max()),
            "allreduces_per_step": result["allreduces_per_step"],
            "same": same_on_every_rank(digest(result["model"])),
        }
    return cases


@checks.register
def check_hierarchical_accumulation_equals_the_large_batch() -> dict[str, Any]:
    result = train(make_fabric(sync="hierarchical"), steps=3, micro=2)
    expected, _ = reference(steps=3, micro=2)
    return {"max_diff": float((flat(result["model"]) - expected).abs().max())}


@checks.register
def check_clipping_sees_averaged_gradients() -> dict[str, Any]:
    result = train(make_fabric(), steps=3, clip=0.05)
    expected, norms = reference(steps=3, micro=1, clip=0.05)
    return {
        "norms": result["norms"],
        "expected_norms": norms,
        "max_diff": float((flat(result["model"]) - expected).abs().max()),
    }


@checks.register
def check_two_optimizers_set_up_apart_keep_distinct_names() -> dict[str, Any]:
    fabric = make_fabric()
    first, second = net(1), net(2)
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second = torch.optim.Adam(second.parameters(), lr=0.01)
    first, opt_first = fabric.setup(first, opt_first)
    second, opt_second = fabric.setup(second, opt_second)
    x, y = data(BATCH * hvd.size() * 3)
    for step in range(3):
        xs, ys = rank_slice(x, step, BATCH), rank_slice(y, step, BATCH)
        fabric.backward(nn.functional.mse_loss(first(xs), ys))
        opt_first.step()
        opt_first.zero_grad()
        fabric.backward(nn.functional.mse_loss(second(first(xs).detach().repeat(1, 6)), ys))
        opt_second.step()
        opt_second.zero_grad()
    names = sorted(
        name for optimizer in (opt_first, opt_second) for name in optimizer.optimizer._parameter_names.values()
    )
    return {"names": names, "same": same_on_every_rank(digest(first) + digest(second))}


@checks.register
def check_collectives() -> dict[str, Any]:
    """Fabric's collectives as DDP answers them: all_reduce in place, all_gather's gradients summed over ranks."""
    fabric = make_fabric()

    def own() -> torch.Tensor:
        return torch.tensor([float(hvd.rank() + 1)])

    fabric.barrier()
    summed = own()
    returned = fabric.all_reduce(summed, reduce_op="sum")
    integers = torch.tensor([hvd.rank() + 1])
    integer_mean = fabric.all_reduce(integers, reduce_op="mean")
    squared = torch.tensor([float(hvd.rank() + 1), 1.0], requires_grad=True)
    (fabric.all_gather(squared, sync_grads=True) ** 2).sum().backward()
    plain = torch.tensor([1.0, 2.0], requires_grad=True)
    fabric.all_gather(plain, sync_grads=True).sum().backward()  # a non-contiguous gradient comes back
    return {
        "mean": float(fabric.all_reduce(own(), reduce_op="mean")),
        "sum": float(fabric.all_reduce(own(), reduce_op="sum")),
        "max": float(fabric.all_reduce(own(), reduce_op="max")),
        "in_place": [summed.tolist(), returned is summed],
        "integer_mean": [str(integer_mean.dtype), integer_mean.tolist(), integers.tolist()],
        "gathered": fabric.all_gather(own()).reshape(-1).tolist(),
        "gathered_gradients": [squared.grad.tolist(), plain.grad.tolist()],
        "broadcast": fabric.broadcast({"from": hvd.rank()}, src=1),
    }


@checks.register
def check_setup_dataloaders_split_the_data() -> dict[str, Any]:
    fabric = make_fabric()
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True))
    seen = sorted(int(i) for (batch,) in loader for i in batch)
    everyone = hvd.allgather_object(seen)
    return {"counts": [len(s) for s in everyone], "union": sorted(set().union(*everyone)) == list(range(40))}


@checks.register
def check_save_once_load_everywhere_and_resume_identically() -> dict[str, Any]:
    fabric = make_fabric()
    path = out_dir() / "fabric_checkpoint.ckpt"
    first = train(fabric, steps=3)
    fabric.save(path, {"model": first["model"], "opt": first["opt"], "step": 3})
    uninterrupted = train(fabric, steps=3, start=3, model=first["model"], opt=first["opt"])
    # a fresh model and optimizer (different on every rank) restored from the file
    fresh = net(hvd.rank() + 20)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh, fresh_opt = fabric.setup(fresh, fresh_opt)
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.add_(hvd.rank())  # ranks differ before the load
    state = {"model": fresh, "opt": fresh_opt}
    remainder = fabric.load(path, state)
    resumed = train(fabric, steps=3, start=3, model=fresh, opt=fresh_opt)
    leftovers = sorted(p.name for p in out_dir().iterdir() if p.name.startswith("fabric_checkpoint") and p != path)
    return {
        "remainder": remainder,
        "resume_diff": float((flat(resumed["model"]) - flat(uninterrupted["model"])).abs().max()),
        "same": same_on_every_rank(digest(resumed["model"])),
        "leftovers": leftovers,
    }


@checks.register
def check_mixed_precision_trains_alike_on_every_rank() -> dict[str, Any]:
    results = {}
    cpu_scaler = hasattr(torch.amp, "GradScaler")  # torch 2.3+
    with_scaler = (
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8)) if cpu_scaler else None
    )
    for precision in ("bf16-mixed", "16-mixed", "16-mixed+GradScaler") if cpu_scaler else ("bf16-mixed", "16-mixed"):
        plugin = {"plugins": [with_scaler]} if precision.endswith("GradScaler") else {"precision": precision}
        fabric = Fabric(accelerator="cpu", strategy=HorovodStrategy(), **plugin)
        fabric.launch()
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = fabric.setup(model, opt)
        x, y = data(BATCH * hvd.size() * 4)
        for step in range(4):
            loss = nn.functional.mse_loss(model(rank_slice(x, step, BATCH).float()), rank_slice(y, step, BATCH).float())
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        results[precision] = {
            "same": same_on_every_rank(digest(model)),
            "scaler": type(scaler).__name__ if scaler is not None else None,
            "loss": float(loss),
        }
    return results


@checks.register
def check_a_layer_unfrozen_while_training_is_averaged() -> dict[str, Any]:
    """A layer frozen at setup and unfrozen later is averaged too (Horovod hooks only what was trainable then).

    Each rank trains on its own rows, so a layer whose gradients stayed local would differ between ranks.
    """
    fabric = make_fabric()
    module = net(RANK_ZERO_SEED + hvd.rank())
    module[0].requires_grad_(False)
    model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    frozen = train(fabric, steps=2, model=model, opt=opt)
    before = module[0].weight.detach().clone()
    module[0].requires_grad_(True)
    unfrozen = train(fabric, steps=3, start=2, model=model, opt=opt)
    return {
        "same": same_on_every_rank(digest(module)),
        "trained": not torch.equal(before, module[0].weight.detach()),
        "allreduces_per_step": [frozen["allreduces_per_step"], unfrozen["allreduces_per_step"]],
    }


@checks.register
def check_schedulers_built_before_setup_set_every_ranks_rates() -> dict[str, Any]:
    """A StepLR built on the optimizer before ``fabric.setup``, handed to setup (``scheduler=``, Fabric 2.4 and
    later) or not: every rank follows its rates, before and after ``fabric.load``, with none of torch's warnings
    about the order of the two steps."""
    fabric = make_fabric()
    cases = {}
    for name in ("handed_to_setup", "kept_by_the_loop"):
        if name == "handed_to_setup" and "scheduler" not in inspect.signature(fabric.setup).parameters:
            cases[name] = {"supported": False}
            continue
        module = net(RANK_ZERO_SEED + hvd.rank())
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "handed_to_setup":
                model, opt, scheduler = fabric.setup(module, optimizer, scheduler=scheduler)
            else:
                model, opt = fabric.setup(module, optimizer)
            rates = []
            for step in range(4):
                if step == 2:  # save and load in the middle: loading replaces the optimizer's param groups
                    path = out_dir() / f"scheduled_{name}.pt"
                    fabric.save(path, {"model": model, "optimizer": opt})
                    fabric.load(path, {"model": model, "optimizer": opt})
                train(fabric, steps=1, start=step, model=model, opt=opt)
                scheduler.step()
                rates.append(opt.param_groups[0]["lr"])
        cases[name] = {
            "supported": True,
            "rates": rates,
            "rates_everywhere": same_on_every_rank(repr(rates)),
            "same": same_on_every_rank(digest(module)),
            "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
        }
    return cases


def wide_net(seed: int) -> nn.Module:
    """Four 400-wide layers in float32 (1.9 MB): 1 MiB buckets cut its compiled graph in two."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 400),
        nn.Tanh(),
        nn.Linear(400, 400),
        nn.Tanh(),
        nn.Linear(400, 400),
        nn.Tanh(),
        nn.Linear(400, 400),
        nn.Tanh(),
        nn.Linear(400, 1),
    )


def compiled_or_eager_run(compiled: bool, **strategy: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """``fabric.setup(torch.compile(model), optimizer)`` (or the eager model), 4 AdamW steps, a save to a file."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fabric = make_fabric(bucket_mb=1.0, **strategy)
    model = wide_net(RANK_ZERO_SEED)
    given = torch.compile(model, backend="aot_eager") if compiled else model
    module, opt = fabric.setup(given, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = data(4 * BATCH * hvd.size())
    x, y = x.float(), y.float()
    for step in range(4):
        rows = slice(step * BATCH * hvd.size(), (step + 1) * BATCH * hvd.size())
        fabric.backward(
            nn.functional.mse_loss(module(x[rows][hvd.rank() :: hvd.size()]), y[rows][hvd.rank() :: hvd.size()])
        )
        opt.step()
        opt.zero_grad()
    path = out_dir() / f"compiled_{compiled}_{strategy.get('shard', 'none')}_{strategy.get('sync', 'allreduce')}.ckpt"
    fabric.save(path, {"model": module})
    names = list(torch.load(path, weights_only=False)["model"])
    return flat(model).float(), {
        "pieces": int(counters["aot_autograd"]["total"]),
        "graph_breaks": sum(counters["graph_break"].values()),
        "compiled_names": [name for name in names if "_orig_mod" in name],
        "names": names == list(wide_net(0).state_dict()),
        "same": same_on_every_rank(digest(model)),
    }


@checks.register
def check_compiled_module_trains_like_eager() -> dict[str, Any]:
    """``fabric.setup(torch.compile(model))`` with each sync and shard mode Fabric takes: the eager run's
    parameters, graphs cut at buckets, no graph break, checkpoints under the module's own names."""
    result: dict[str, Any] = {}
    for name, strategy in (
        ("allreduce", {}),
        ("zero2", {"shard": "gradients"}),
        ("hierarchical", {"sync": "hierarchical"}),
    ):
        eager, _ = compiled_or_eager_run(False, **strategy)
        compiled, facts = compiled_or_eager_run(True, **strategy)
        result[name] = {"vs_eager": float((compiled - eager).abs().max()), **facts}
    return result


@checks.register
def check_daso_is_refused_at_construction() -> str:
    try:
        HorovodStrategy(sync="daso")
    except ValueError as error:
        return str(error)
    return "accepted"


if __name__ == "__main__":
    OUT, _ = parse_out()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    report = checks.run()
    write_result(OUT, hvd.rank(), report)
    Path(OUT / f"pid{hvd.rank()}").write_text(str(os.getpid()))
