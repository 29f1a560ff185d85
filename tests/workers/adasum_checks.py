"""Adasum under ``horovodrun --mpi``: Horovod's reduction against Adasum's definition, and training with it.

Adasum of two vectors a, b: (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, applied recursively to pairs
of workers (0+1, 2+3, then the two results). Every rank runs every check and writes its report. The
suite runs ``checks`` inside its MPI jobs of two workers (strategy_features.py) and of two nodes of two
workers (hierarchical_checks.py) rather than launching this script.
"""

from __future__ import annotations

import hashlib
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl
import torch
from _common import Checks, parse_out, write_result
from finetuning import UnfreezeExtra
from models import Regression, TwoHeads, noiseless_regression
from torch import nn

from hvd_plugins.pytorch import HorovodStrategy

checks = Checks()


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dot = a @ b
    return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b


def adasum_of(vectors: list[torch.Tensor]) -> torch.Tensor:
    """Neighbours first, then pairs of their results (the order of Horovod's recursive halving)."""
    while len(vectors) > 1:
        vectors = [adasum_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


@checks.register
def adasum_definition() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(100 + hvd.rank())
    shared = torch.randn(1003, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    mine = 0.5 * shared + torch.randn(1003, dtype=torch.float64, generator=generator)  # correlated, not equal
    everyone = list(hvd.allgather(mine.unsqueeze(0), name="adasum.inputs"))
    got = hvd.allreduce(mine, op=hvd.Adasum, name="adasum.random")
    same = hvd.allreduce(shared, op=hvd.Adasum, name="adasum.identical")  # Adasum(a, a) = a
    expected = adasum_of(everyone)
    return {
        "relative_error": float((got - expected).norm() / expected.norm()),
        "differs_from_sum": float((got - torch.stack(everyone).sum(0)).norm() / expected.norm()),
        "identical_inputs_error": float((same - shared).abs().max()),
    }


def trainer(**kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        strategy=HorovodStrategy(op="adasum"),
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**options, **kwargs})


@checks.register
def adasum_training() -> dict[str, Any]:
    model = Regression(loss_name="loss")
    loader = noiseless_regression()
    first = float(nn.functional.mse_loss(model.layer(loader.dataset.tensors[0]), loader.dataset.tensors[1]))
    t = trainer()
    t.fit(model, loader)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {
        "first_loss": first,
        "final_loss": float(t.callback_metrics["loss"]),
        "steps": t.global_step,
        "ranks_identical": len(set(hvd.allgather_object(digest))) == 1,
    }


@checks.register
def adasum_unfrozen_layer() -> dict[str, Any]:
    """A layer unfrozen mid-training trains under Adasum, and every rank holds the same weights.

    Horovod's Adasum optimizer steps each parameter inside its backward hook; without a hook the
    unfrozen layer would never step (or, stepped locally, would differ between the ranks' batches).
    """
    cases = {}
    for name, new_group in (("new_param_group", True), ("in_place", False)):
        model = TwoHeads(extra_in_optimizer=not new_group, lr=0.02)
        before = model.extra.weight.detach().clone()
        trainer(callbacks=[UnfreezeExtra(new_group)]).fit(model, noiseless_regression())
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        cases[name] = {
            "extra_trained": not torch.equal(before, model.extra.weight.detach()),
            "ranks_identical": len(set(hvd.allgather_object(digest))) == 1,
        }
    return cases


def refused(**kwargs: Any) -> str | None:
    try:
        trainer(max_epochs=1, **kwargs).fit(Regression(loss_name="loss"), noiseless_regression())
    except ValueError as error:
        return str(error)
    return None


@checks.register
def adasum_refuses_accumulation() -> str | None:
    return refused(accumulate_grad_batches=2)


@checks.register
def adasum_refuses_clipping() -> str | None:
    return refused(gradient_clip_val=1.0)


@checks.register
def adasum_runs_on_mpi() -> dict[str, Any]:
    """How Horovod runs the job these checks ran in."""
    return {"mpi_enabled": bool(hvd.mpi_enabled()), "size": hvd.size()}


if __name__ == "__main__":
    OUT, ARGS = parse_out()
    hvd.init()
    write_result(OUT, hvd.rank(), checks.selected(ARGS.case).run())
