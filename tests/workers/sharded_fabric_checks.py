"""Sharded training on Fabric (``shard="optimizer"`` and ``shard="gradients"``) against ``shard="none"``.

Run under ``horovodrun -np 4 -H localhost:2,127.0.0.1:2`` (two emulated nodes). Every check trains a
plain Fabric loop (``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``,
``optimizer.zero_grad()``) on a float32 dataset that ``fabric.setup_dataloaders`` splits with a
DistributedSampler, once per stage from the same start, and reports what the tests compare: the
parameters (float32: the order of the sums is the only difference), the clipped norms, the optimizer
state each worker holds, and what ``fabric.save`` wrote.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable
from typing import Any

import horovod.torch as hvd
import torch
from _common import Checks, out_dir, parse_out, write_result
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hvd_plugins.core.sync.meta import materialize
from hvd_plugins.fabric import HorovodStrategy
from hvd_plugins.fabric.lightning_internals import fabric_optimizer_target

checks = Checks()
SHARDS = ("optimizer", "gradients")
STAGES = ("none", *SHARDS)
BATCH = 4
"""Samples per worker and micro-batch."""
STEPS = 24
TIME_LIMIT = 180.0
"""Seconds a check may take (each takes a few): a hang in a collective fails the job, not the suite's timeout."""
SMALL_BUCKETS_MB = 0.001
"""262 float32 elements: the model's parameters fall into several buckets, each padded to a multiple of 4."""


def make_fabric(shard: str, bucket_mb: float = SMALL_BUCKETS_MB, **options: Any) -> Fabric:
    fabric = Fabric(strategy=HorovodStrategy(shard=shard, bucket_mb=bucket_mb), accelerator="cpu", **options)
    fabric.launch()
    return fabric


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(name: str, module: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    return torch.optim.Adam(module.parameters(), lr=0.01)


def set_up(fabric: Fabric, optimizer: str, in_init_module: bool = False) -> tuple[Any, Any]:
    """A model that differs on every worker until ``fabric.setup`` broadcasts rank 0's, and its optimizer;
    ``in_init_module``: built inside ``fabric.init_module()`` (on the meta device when fully sharded)."""
    with fabric.init_module() if in_init_module else contextlib.nullcontext():
        module = net(3 + hvd.rank())
    return fabric.setup(module, make_optimizer(optimizer, module))


def batches(fabric: Fabric, micro: int = 1) -> Any:
    """``STEPS * micro`` batches a worker: the data set shuffled and split by Fabric's DistributedSampler."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * micro * BATCH * hvd.size(), 8, generator=generator)
    y = (x[:, :3].sum(1, keepdim=True) - x[:, 3:4] * x[:, 4:5]).tanh()
    return fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True))


def train(
    fabric: Fabric, model: Any, optimizer: Any, loader: Iterable[Any], clip: dict[str, Any] | None, micro: int = 1
) -> list[float]:
    """Steps over ``loader``, ``micro`` micro-batches a step (all but the last under ``no_backward_sync``),
    clipped with ``fabric.clip_gradients(**clip)``; the norms that clipping by norm returned."""
    norms = []
    for index, (x, y) in enumerate(loader):
        last = (index + 1) % micro == 0
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(nn.functional.mse_loss(model(x), y) / micro)
        if not last:
            continue
        if clip is not None:
            norm = fabric.clip_gradients(model, optimizer, **clip)
            if norm is not None:
                norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, relative to the largest expected value."""
    return float((found - expected).abs().max() / expected.abs().max())


def held_state(optimizer: Any) -> dict[str, Any]:
    """The optimizer state this worker holds: ``state_bytes()`` of a sharded optimizer, and for every optimizer
    the bytes of its tensors of state kept per element (Adam's moments) and of its scalar ones (step counts)."""
    target = fabric_optimizer_target(optimizer)
    inner = getattr(target, "inner", None)  # what steps a sharded optimizer's slices
    holder = inner if inner is not None else target
    tensors = [v for state in holder.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "state_bytes": target.state_bytes() if hasattr(target, "state_bytes") else None,
        "moment_bytes": sum(v.numel() * v.element_size() for v in tensors if v.dim() > 0),
        "scalar_bytes": sum(v.numel() * v.element_size() for v in tensors if v.dim() == 0),
        "slices": len(getattr(target, "slices", [])),
        "parameters": sum(p.numel() for group in target.param_groups for p in group["params"]),
        "parameter_tensors": sum(len(group["params"]) for group in target.param_groups),
        "sharded": hasattr(target, "slices"),
    }


def identical_across_workers(module: nn.Module) -> bool:
    values = flat(module)
    return bool((hvd.allgather(values.unsqueeze(0)) == values).all())


CASES: dict[str, tuple[str, dict[str, Any], float]] = {
    "adam_max_norm": ("adam", {"max_norm": 0.1}, SMALL_BUCKETS_MB),
    "adamw_clip_val": ("adamw", {"clip_val": 0.002}, SMALL_BUCKETS_MB),
    "adam_inf_norm_one_bucket": ("adam", {"max_norm": 0.02, "norm_type": float("inf")}, 32.0),
}
"""Optimizer, ``fabric.clip_gradients`` arguments and bucket size of each case."""


@checks.register(time_limit=TIME_LIMIT)
def check_equal_to_unsharded() -> dict[str, Any]:
    """Each case, every stage, ``STEPS`` steps from the same start: parameters, norms, state held. An unclipped
    unsharded run shows that clipping changed the training."""
    found: dict[str, Any] = {}
    for case, (optimizer_name, clip, bucket_mb) in CASES.items():
        runs: dict[str, Any] = {}
        for stage in (*STAGES, "unclipped"):
            fabric = make_fabric("none" if stage == "unclipped" else stage, bucket_mb)
            model, optimizer = set_up(fabric, optimizer_name)
            loader = batches(fabric)
            norms = train(fabric, model, optimizer, loader, None if stage == "unclipped" else clip)
            runs[stage] = {
                "parameters": flat(model),
                "norms": norms,
                "state": held_state(optimizer),
                "identical": identical_across_workers(model),
                "distributed_sampler": isinstance(loader.sampler, DistributedSampler),
                "steps": len(loader),
            }
        expected = runs["none"]["parameters"]
        found[case] = {
            stage: {
                "difference": relative(run["parameters"], expected),
                "norms": run["norms"],
                "state": run["state"],
                "identical": run["identical"],
                "distributed_sampler": run["distributed_sampler"],
                "steps": run["steps"],
            }
            for stage, run in runs.items()
        }
    return found


@checks.register(time_limit=TIME_LIMIT)
def check_no_backward_sync_accumulation_equals_unsharded() -> dict[str, Any]:
    """Two micro-batches a step, the first under ``fabric.no_backward_sync``, clipped by norm."""
    parameters, norms = {}, {}
    for stage in STAGES:
        fabric = make_fabric(stage)
        model, optimizer = set_up(fabric, "adamw")
        norms[stage] = train(fabric, model, optimizer, batches(fabric, micro=2), {"max_norm": 0.1}, micro=2)
        parameters[stage] = flat(model)
    return {
        stage: {"difference": relative(parameters[stage], parameters["none"]), "norms": norms[stage]}
        for stage in STAGES
    }


@checks.register(time_limit=TIME_LIMIT)
def check_checkpoint_holds_the_whole_state_and_resumes() -> dict[str, Any]:
    """ZeRO-2 and unsharded train half the steps and ``fabric.save``; rank 0 compares the two files' optimizer
    states. Fresh models and optimizers of each stage ``fabric.load`` the ZeRO-2 file and train on."""
    half = STEPS // 2
    paths, held_before_save = {}, {}
    for stage in ("gradients", "none"):
        fabric = make_fabric(stage)
        model, optimizer = set_up(fabric, "adamw")
        train(fabric, model, optimizer, itertools.islice(batches(fabric), half), {"max_norm": 0.1})
        held_before_save[stage] = held_state(optimizer)
        paths[stage] = out_dir() / f"fabric_{stage}.ckpt"
        fabric.save(paths[stage], {"model": model, "optimizer": optimizer, "step": half})
    saved = compare_saved(paths["gradients"], paths["none"]) if hvd.rank() == 0 else {}
    resumed, remainders, held_after_load = {}, {}, {}
    for stage in STAGES:
        fabric = make_fabric(stage)
        model, optimizer = set_up(fabric, "adamw")  # other parameters than saved, on every worker
        remainders[stage] = fabric.load(paths["gradients"], {"model": model, "optimizer": optimizer})
        held_after_load[stage] = held_state(optimizer)
        train(fabric, model, optimizer, itertools.islice(batches(fabric), half, None), {"max_norm": 0.1})
        resumed[stage] = flat(model)
    return {
        "saved": saved,
        "remainders": remainders,
        "held_before_save": held_before_save,
        "held_after_load": held_after_load,
        "resumed": {stage: relative(resumed[stage], resumed["none"]) for stage in STAGES},
    }


def compare_saved(sharded_path: Any, plain_path: Any) -> dict[str, Any]:
    """The largest difference between the optimizer states of two checkpoints, and whether they have one layout.

    Rank 0 alone reads them, so nothing here may raise: the other workers would wait for it in the next collective.
    """
    try:
        sharded = torch.load(sharded_path, weights_only=False)["optimizer"]
        plain = torch.load(plain_path, weights_only=False)["optimizer"]
        pairs = [
            (torch.as_tensor(sharded["state"].get(index, {}).get(key, float("nan"))), torch.as_tensor(value))
            for index, values in plain["state"].items()
            for key, value in values.items()
        ]
        return {
            "state_difference": max(
                float((found - expected).abs().max()) if found.shape == expected.shape else float("inf")
                for found, expected in pairs
            ),
            "entries": len(pairs),
            "same_parameters": sorted(sharded["state"]) == sorted(plain["state"]),
            "same_keys": all(sorted(sharded["state"][i]) == sorted(plain["state"][i]) for i in plain["state"]),
            "same_shapes": all(found.shape == expected.shape for found, expected in pairs),
            "same_param_groups": sharded["param_groups"] == plain["param_groups"],
            "optimizer_parameters": sum(len(group["params"]) for group in plain["param_groups"]),
        }
    except Exception as error:  # reported for the test to show
        return {"error": f"{type(error).__name__}: {error}"}


INITIAL_SCALE = 2.0**17
"""Large enough that the first steps' float16 gradients overflow: the GradScaler skips them and halves its scale."""


def grad_scaler() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE))


@checks.register(time_limit=TIME_LIMIT)
def check_a_grad_scaler_under_zero1_and_zero2() -> dict[str, Any]:
    """16-mixed with a GradScaler, clipped by norm (unscaled first): ZeRO-1 keeps the whole averaged gradients and
    trains as unsharded, skipped steps included; ZeRO-2, which frees them, is refused at ``fabric.setup``."""
    parameters, scales, norms = {}, {}, {}
    for stage in ("none", "optimizer"):
        fabric = make_fabric(stage, plugins=[grad_scaler()])
        model, optimizer = set_up(fabric, "adam")
        clip = {"max_norm": 0.1, "error_if_nonfinite": False}  # the overflowing steps' norm is not finite
        norms[stage] = train(fabric, model, optimizer, batches(fabric), clip)
        parameters[stage] = flat(model)
        scales[stage] = float(fabric.strategy.precision.scaler.get_scale())
    fabric = make_fabric("gradients", plugins=[grad_scaler()])
    try:
        set_up(fabric, "adam")
        refused = "accepted"
    except ValueError as error:
        refused = str(error)
    return {
        "difference": relative(parameters["optimizer"], parameters["none"]),
        "scales": scales,
        "norms": norms,
        "refused": refused,
    }


@checks.register(time_limit=TIME_LIMIT)
def check_accumulating_without_no_backward_sync_is_refused() -> dict[str, str]:
    """A second backward before the step without ``no_backward_sync``: the first one's buckets are on their way,
    so sharding refuses, naming what to use instead. Last in the job: the refused step's buckets stay unused."""
    found = {}
    for stage in SHARDS:
        fabric = make_fabric(stage)
        model, optimizer = set_up(fabric, "adam")
        x, y = next(iter(batches(fabric)))
        try:
            for _ in range(2):
                fabric.backward(nn.functional.mse_loss(model(x), y))
            found[stage] = "accepted"
        except ValueError as error:
            found[stage] = str(error)
        fabric.strategy.gradient_sync.synchronize(fabric_optimizer_target(optimizer))  # the first backward's sums
    return found


def whole_state(fabric: Fabric, model: Any) -> torch.Tensor:
    """The model's parameters as a checkpoint holds them (gathered, with ``shard="parameters"``), in order."""
    state = fabric.strategy.get_module_state_dict(model.module)
    return torch.cat([state[name].detach().reshape(-1).double() for name, _ in model.module.named_parameters()])


@checks.register(time_limit=TIME_LIMIT)
def check_full_sharding() -> dict[str, Any]:
    """``shard="parameters"`` with every Linear a unit, clipped by norm: the parameters as unsharded, none held
    whole between steps; ``fabric.save`` writes the whole model, which a fresh fully sharded setup loads. Also
    built inside ``fabric.init_module()``, on the meta device. The gathered state is rank 0's to compare."""
    found: dict[str, Any] = {}

    def fully_sharded_or_not(stage: str) -> Fabric:
        shard = "none" if stage == "none" else "parameters"
        options = {"auto_wrap_policy": {nn.Linear}} if shard == "parameters" else {}
        fabric = Fabric(
            strategy=HorovodStrategy(shard=shard, bucket_mb=SMALL_BUCKETS_MB, **options), accelerator="cpu"
        )
        fabric.launch()
        return fabric

    for stage in ("none", "parameters", "meta"):
        fabric = fully_sharded_or_not(stage)
        model, optimizer = set_up(fabric, "adamw", in_init_module=stage == "meta")
        norms = train(fabric, model, optimizer, batches(fabric), {"max_norm": 0.1})
        held = sum(p.numel() for p in model.parameters())
        path = out_dir() / f"fabric_full_{stage}.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        fresh = fully_sharded_or_not(stage)  # one model per strategy with shard="parameters"
        again, again_optimizer = set_up(fresh, "adamw")
        fresh.load(path, {"model": again, "optimizer": again_optimizer})
        found[stage] = {
            "parameters": whole_state(fabric, model),
            "loaded": whole_state(fresh, again),
            "norms": norms,
            "held": held,
        }
    expected = found["none"]["parameters"]
    rank_zero = hvd.rank() == 0
    return {
        "difference": relative(found["parameters"]["parameters"], expected) if rank_zero else None,
        "loaded": relative(found["parameters"]["loaded"], expected) if rank_zero else None,
        "meta": relative(found["meta"]["parameters"], expected) if rank_zero else None,
        "norms": [found[stage]["norms"] for stage in ("none", "parameters", "meta")],
        "held": [found[stage]["held"] for stage in ("none", "parameters", "meta")],
    }


class TiedGPT(nn.Module):
    """A GPT that ties its head by use (``norm(h) @ embed.weight.t()``): embedding, position parameter, a two-layer
    ``nn.TransformerEncoder``, a final norm. Built in ``fabric.init_module(empty_init=True)`` it is on the meta
    device: ``reset_parameters`` of its own makes it real."""

    def __init__(self, vocab: int = 48, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(1, 16, width))
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(tokens) + self.position[:, : tokens.shape[1]])
        return self.norm(h) @ self.embed.weight.t()


class AttentionBlock(nn.Module):
    """``LayerNorm``, torch's ``nn.MultiheadAttention`` (which reads ``out_proj.weight`` without calling it), an MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class AttentionGPT(nn.Module):
    """Embedding, three ``AttentionBlock`` in a ``ModuleList``, a separate output head."""

    def __init__(self, vocab: int = 48, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(AttentionBlock(width) for _ in range(3))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class AdapterBlock(AttentionBlock):
    """An ``AttentionBlock`` followed by a small adapter: the block is the frozen base, the adapter trains."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.adapter = nn.Sequential(nn.Linear(width, 4, bias=False), nn.Linear(4, width, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x + self.adapter(x)


def frozen_base_gpt(vocab: int = 48, width: int = 32) -> nn.Module:
    """``AttentionGPT`` of ``AdapterBlock``, everything frozen but the adapters and the head (a frozen base under
    trainable adapters): the first block's input needs no gradient, the later ones' do, through frozen weights."""
    model = AttentionGPT(vocab, width)
    model.blocks = nn.ModuleList(AdapterBlock(width) for _ in range(3))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("adapter" in name or name.startswith("head."))
    return model


def token_batches(steps: int, vocab: int = 48) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's share of ``steps`` batches of 2 sequences of 12 tokens (each worker its own, alike each run)."""
    generator = torch.Generator().manual_seed(11 + hvd.rank())
    data = torch.randint(0, vocab, (steps, 2, 13), generator=generator)
    return [(row[:, :-1], row[:, 1:]) for row in data]


def built_empty(fabric: Fabric, make: Any, shard: str) -> nn.Module:
    """``make()`` in ``fabric.init_module(empty_init=True)`` (on the meta device, made real as the model is sharded);
    unsharded, on the meta device made real here, which draws the same values (each worker its own: rank 0's win)."""
    torch.manual_seed(5 + hvd.rank())
    if shard == "parameters":
        with fabric.init_module(empty_init=True):
            return make()
    with torch.device("meta"):
        model = make()
    materialize(model, torch.device("cpu"))
    return model


def run_order(shard: str, make: Any, order: str, steps: int = 4) -> dict[str, Any]:
    """Train ``make()`` with the default units for ``steps`` steps, set up in ``order``: ``"model_first"``
    (``fabric.setup(model)``, then ``fabric.setup_optimizers`` over ``model.parameters()``, as litgpt does, built in
    ``init_module(empty_init=True)``), ``"split_later"`` (the same with two optimizers, the second over the head's
    bias alone: they split the model's own unit) or ``"together"``; then predict under ``no_grad``. The gathered
    parameters are rank 0's to compare; ``moved``: the parameters whose memory setting the optimizers up changed."""
    fabric = Fabric(strategy=HorovodStrategy(shard=shard, bucket_mb=SMALL_BUCKETS_MB), accelerator="cpu")
    fabric.launch()
    moved: list[str] = []
    if order in ("model_first", "split_later"):
        model = fabric.setup(built_empty(fabric, make, shard))
        held_at = {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters() if p.numel()}
        named = list(model.named_parameters())
        split = order == "split_later"
        groups = [
            [p for n, p in named if not (split and n.endswith("head.bias"))],
            [p for n, p in named if split and n.endswith("head.bias")],
        ]
        optimizers = fabric.setup_optimizers(*(torch.optim.SGD(g, lr=0.1, momentum=0.9) for g in groups if g))
        optimizer = Both(optimizers if isinstance(optimizers, (list, tuple)) else [optimizers])
        now = {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters() if p.numel()}
        moved = sorted(name for name, at in held_at.items() if now.get(name) != at)
    else:
        torch.manual_seed(5)
        module = make()
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    held, after_backward = [], []
    for tokens, targets in token_batches(steps):
        logits = model(tokens)
        fabric.backward(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
        after_backward.append(
            {
                "whole": sum(p.numel() for p in model.parameters()),
                "gradients": sum(p.grad.numel() for p in model.parameters() if p.grad is not None),
            }
        )
        optimizer.step()
        optimizer.zero_grad()
        held.append(sum(p.numel() for p in model.parameters()))
    with torch.no_grad():
        predicted = model(token_batches(1)[0][0])
    state = model.state_dict()  # whole tensors, gathered one unit at a time (a collective)
    return {
        "parameters": torch.cat([state[n].detach().reshape(-1).double() for n, _ in model.module.named_parameters()]),
        "predicted": predicted.double(),
        "held_after_step": min(held),
        "whole": sum(state[name].numel() for name, _ in model.module.named_parameters()),
        "after_backward": after_backward[0],
        "shards": shards_against_state(fabric, state) if shard == "parameters" else None,
        "moved": moved,
    }


class Both:
    """Several optimizers stepped and zeroed as one."""

    def __init__(self, optimizers: Iterable[Any]) -> None:
        self.optimizers = list(optimizers)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()


def shards_against_state(fabric: Fabric, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every worker's ``local_shards()`` gathered and laid into whole tensors, against the whole state."""
    mine = {name: (s.start, s.values.tolist(), tuple(s.shape)) for name, s in fabric.strategy.local_shards().items()}
    rebuilt: dict[str, torch.Tensor] = {}
    for worker in hvd.allgather_object(mine):
        for name, (start, values, shape) in worker.items():
            flat = rebuilt.setdefault(name, torch.full((math.prod(shape),), float("nan"), dtype=torch.float64))
            flat[start : start + len(values)] = torch.tensor(values, dtype=torch.float64)
    return {
        "names": sorted(rebuilt),
        "state_names": sorted(name for name, value in state.items() if value.is_floating_point()),
        "difference": max(float((rebuilt[n] - state[n].double().reshape(-1)).abs().max()) for n in rebuilt),
        "held_here": sum(len(values) for _, values, _ in mine.values()),
    }


def evaluate_alone(shard: str, make: Any) -> dict[str, Any]:
    """``fabric.setup(model)`` and no optimizer at all: a forward under ``no_grad``, sharded at setup."""
    fabric = Fabric(strategy=HorovodStrategy(shard=shard, bucket_mb=SMALL_BUCKETS_MB), accelerator="cpu")
    fabric.launch()
    model = fabric.setup(built_empty(fabric, make, shard))
    with torch.no_grad():
        predicted = model(token_batches(1)[0][0])
    return {
        "predicted": predicted.double(),
        "held": sum(p.numel() for p in model.parameters()),
        "whole": sum(p.numel() for p in make().parameters()),
    }


@checks.register(time_limit=TIME_LIMIT)
def check_zero3_in_users_orders() -> dict[str, Any]:
    """``shard="parameters"`` with the default units (no policy) on a GPT that ties its head by use, on one built
    of ``nn.MultiheadAttention`` blocks, and on a frozen base under trainable adapters; set up model first (litgpt's
    order) and together; predicting after the steps, and evaluating with no optimizer ever set up: every result as
    unsharded."""
    found: dict[str, Any] = {}
    for name, make, order in (
        ("tied_model_first", TiedGPT, "model_first"),
        ("attention", AttentionGPT, "together"),
        ("frozen_base", frozen_base_gpt, "model_first"),
        ("split_later", AttentionGPT, "split_later"),
    ):
        plain, sharded = run_order("none", make, order), run_order("parameters", make, order)
        found[name] = {
            "difference": relative(sharded["parameters"], plain["parameters"]),
            "predicted": relative(sharded["predicted"], plain["predicted"]),
            "held_after_step": sharded["held_after_step"],
            "whole": plain["whole"],
            "after_backward": sharded["after_backward"],
            "shards": sharded["shards"],
            "moved": sharded["moved"],
        }
    plain, sharded = evaluate_alone("none", TiedGPT), evaluate_alone("parameters", TiedGPT)
    found["evaluate_alone"] = {
        "predicted": relative(sharded["predicted"], plain["predicted"]),
        "held": sharded["held"],
        "whole": sharded["whole"],
    }
    found["freed_read"] = freed_read_error()
    return found


def freed_read_error() -> str:
    """``auto_wrap_policy={nn.Linear}`` on ``AttentionGPT``: ``out_proj`` is a unit that ``nn.MultiheadAttention``
    reads without calling it. The first forward fails on every worker alike; its error and notes, as text."""
    fabric = Fabric(strategy=HorovodStrategy(shard="parameters", auto_wrap_policy={nn.Linear}), accelerator="cpu")
    fabric.launch()
    module = AttentionGPT()
    model, _ = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    try:
        model(token_batches(1)[0][0])
    except RuntimeError as error:
        return "\n".join([str(error), *getattr(error, "__notes__", [])])
    return "no error"


def all_token_batches(steps: int, vocab: int = 48) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every worker's ``token_batches``, joined per step: the whole batch one process would train on."""
    generator_batches = []
    for rank in range(hvd.size()):
        generator = torch.Generator().manual_seed(11 + rank)
        generator_batches.append(torch.randint(0, vocab, (steps, 2, 13), generator=generator))
    data = torch.cat(generator_batches, dim=1)
    return [(row[:, :-1], row[:, 1:]) for row in data]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def one_process_with_torch_clipping(start: dict[str, torch.Tensor], steps: int, max_norm: float) -> dict[str, Any]:
    """``AttentionGPT`` from ``start`` trained by one process on every worker's batches, clipped by torch (SGD with
    momentum: AdamW's first steps make near-zero gradients' rounding as large as the learning rate)."""
    model = AttentionGPT()
    model.load_state_dict(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for tokens, targets in all_token_batches(steps):
        token_loss(model(tokens), targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    parameters = torch.cat([state[n].reshape(-1).double() for n, _ in model.named_parameters()])
    return {"parameters": parameters, "norms": norms}


@checks.register(time_limit=TIME_LIMIT)
def check_zero3_model_holds_its_shards() -> dict[str, Any]:
    """``shard="parameters"``, written as plain torch code: ``fabric.setup(model)`` on a model built in
    ``init_module(empty_init=True)`` shards it at once, so ``model.parameters()`` are this worker's shards; with
    no optimizer yet, ``model.load_state_dict(whole)`` and ``fabric.load`` of a whole checkpoint fill them; an
    optimizer over ``model.parameters()`` set up afterwards trains, clipped by ``torch.nn.utils.clip_grad_norm_`` after
    ``fabric.backward``, as one process does. A model with a parameter kept whole refuses torch's clipping."""
    steps, max_norm = 3, 0.05
    torch.manual_seed(7)
    start = AttentionGPT().state_dict()  # alike on every worker
    torch.manual_seed(8)
    other = AttentionGPT().state_dict()
    fabric = Fabric(strategy=HorovodStrategy(shard="parameters", bucket_mb=SMALL_BUCKETS_MB), accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        module = AttentionGPT()
    model = fabric.setup(module)
    numel_here = sum(p.numel() for p in model.parameters())
    model.load_state_dict(other)
    loaded = model.state_dict()
    load_difference = max(float((loaded[k] - other[k]).abs().max()) for k in other)
    path = out_dir() / "zero3_whole_start.ckpt"
    if hvd.rank() == 0:
        torch.save({"model": start}, path)  # a whole checkpoint, as one process writes it
    hvd.barrier()
    fabric.load(path, {"model": model})
    held = {name: p.untyped_storage().data_ptr() for name, p in model.named_parameters() if p.numel()}
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    numel_with_optimizer = sum(p.numel() for p in model.parameters())
    stepped = {piece.untyped_storage().data_ptr() for piece in optimizer.optimizer.slices}
    moved = sorted(name for name, at in held.items() if at not in stepped)  # copied, not taken over
    norms = []
    for tokens, targets in token_batches(steps):
        fabric.backward(token_loss(model(tokens), targets))
        shard_gradients = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    parameters = torch.cat([state[n].reshape(-1).double() for n, _ in model.module.named_parameters()])
    reference = one_process_with_torch_clipping(start, steps, max_norm)
    return {
        "numel_here": numel_here,
        "numel_with_optimizer": numel_with_optimizer,
        "moved": moved,
        "shard_gradients": shard_gradients,
        "whole": sum(value.numel() for value in start.values()),
        "load_difference": load_difference,
        "difference": relative(parameters, reference["parameters"]),
        "norms": norms,
        "one_process_norms": reference["norms"],
        "refused": torch_clipping_refused_with_a_whole_parameter(),
        "backward_alone": backward_refused_with_no_optimizer(),
    }


@checks.register(time_limit=TIME_LIMIT)
def check_torch_clipping_after_backward() -> dict[str, Any]:
    """Unsharded and ``shard="optimizer"``: ``torch.nn.utils.clip_grad_norm_`` right after ``fabric.backward``
    reads gradients already averaged (as DDP's backward leaves them), so it clips as one process does."""
    steps, max_norm = 3, 0.05
    torch.manual_seed(7)
    start = AttentionGPT().state_dict()
    reference = one_process_with_torch_clipping(start, steps, max_norm)
    found: dict[str, Any] = {}
    for shard in ("none", "optimizer"):
        fabric = Fabric(strategy=HorovodStrategy(shard=shard, bucket_mb=SMALL_BUCKETS_MB), accelerator="cpu")
        fabric.launch()
        module = AttentionGPT()
        module.load_state_dict(start)
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
        norms = []
        for tokens, targets in token_batches(steps):
            fabric.backward(token_loss(model(tokens), targets))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            optimizer.step()
            optimizer.zero_grad()
        parameters = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        found[shard] = {"difference": relative(parameters, reference["parameters"]), "norms": norms}
    found["one_process_norms"] = reference["norms"]
    return found


def torch_clipping_refused_with_a_whole_parameter() -> str:
    """``TiedGPT`` keeps ``position`` (registered on the model itself) whole: its gradient lives in slices only, so
    a norm over ``model.parameters()`` cannot include it. The error, as text."""
    fabric = Fabric(strategy=HorovodStrategy(shard="parameters"), accelerator="cpu")
    fabric.launch()
    model = fabric.setup(TiedGPT())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    tokens, targets = token_batches(1)[0]
    fabric.backward(token_loss(model(tokens), targets))
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except ValueError as error:
        return str(error)
    finally:
        optimizer.zero_grad()
    return "no error"


def backward_refused_with_no_optimizer() -> str:
    """A model set up alone: no slice takes gradients until an optimizer is set up over it. The error, as text."""
    fabric = Fabric(strategy=HorovodStrategy(shard="parameters"), accelerator="cpu")
    fabric.launch()
    model = fabric.setup(AttentionGPT())
    tokens, targets = token_batches(1)[0]
    try:
        fabric.backward(token_loss(model(tokens), targets))
    except ValueError as error:
        return str(error)
    return "no error"


if __name__ == "__main__":
    out, arguments = parse_out()
    hvd.init()
    torch.set_num_threads(1)
    report = checks.selected(arguments.case).run(on_time_limit=lambda partial: write_result(out, hvd.rank(), partial))
    write_result(out, hvd.rank(), report)
