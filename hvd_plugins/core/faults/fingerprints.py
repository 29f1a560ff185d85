"""What every rank must agree on before the first collective, or that collective would deadlock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.comm.parameters import indexed_optimizer_parameters


def optimizer_fingerprint(optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """What must be equal on every rank about the optimizers (Horovod wraps each with its own collectives)."""
    return {
        "optimizers": [
            (type(o).__name__, [(group, tuple(p.shape)) for group, _, p in indexed_optimizer_parameters(o)])
            for o in optimizers
        ]
    }


def job_fingerprint(config_fingerprint: dict[str, Any], model: Module, accumulate: int, stage: str) -> dict[str, Any]:
    """What must be equal on every rank about the job: settings, accumulation, parameter names and shapes, stage."""
    return {
        **config_fingerprint,
        "accumulate_grad_batches": accumulate,
        "parameters": [(name, tuple(p.shape)) for name, p in model.named_parameters()],
        "trainer_fn": stage,
    }
