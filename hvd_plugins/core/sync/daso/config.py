"""DASO knobs as a typed, validated config.

Defaults follow the reference implementation except ``downcast``: the reference sends bfloat16,
we default to fp16, which every Horovod build can reduce. Both halve the bytes, and because
``daso.parameter_sync`` sends the drift since the last sync rather than the weights, the rounding
of either stays small. bf16 needs a Horovod that takes bfloat16 (``hvd-build-horovod``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

Downcast = Literal["fp16", "bf16", "fp32"]
DOWNCAST_TYPES: tuple[str, ...] = get_args(Downcast)
Cycling = Literal["auto", "always"]
CYCLING_CHOICES: tuple[str, ...] = get_args(Cycling)


@dataclass(frozen=True)
class DasoConfig:
    """Settings of the DASO schedule and its cross-node parameter sync."""

    warmup_epochs: int = 4
    """Epochs at the start run as synchronous data parallelism, gradients averaged over all workers."""
    cooldown_epochs: int = 4
    """Epochs at the end run as synchronous data parallelism, like warmup."""
    stability_level: float = 0.05
    """Relative loss improvement below which an epoch counts as 'not improving'."""
    max_global_skips: int = 8
    """Most batches between two cross-node syncs."""
    skip_reduction_factor: int = 2
    """Divisor applied to global_skips (and local skips) when the loss has stabilised."""
    local_skip_factor: int = 4
    """batches_to_wait on a reset is max_global_skips // local_skip_factor."""
    stable_epochs: int = 2
    """Patience of the plateau detector (heat's). The skips shrink on the ``stable_epochs + 1``-th
    consecutive cycling epoch without improvement; 0 shrinks on every non-improving epoch."""
    sending_chunk_size: int = 10_000_000
    """Largest number of elements in one cross-node message."""
    downcast: Downcast = "fp16"
    """Wire type of the cross-node parameters, 'fp16' (the default here, half the bytes; the drift
    since the last sync is what is sent, so its rounding stays small), 'bf16' (the reference's choice:
    half the bytes too, float32's range; needs a Horovod that takes bfloat16) or 'fp32'. The gradients
    of warmup and cooldown travel in the same type."""
    downcast_optimizer_state: bool = False
    """Send the optimizer state of the closing syncs in the ``downcast`` type instead of float32, which
    halves the bytes of that state. With 'fp16' small second moments (Adam's ``exp_avg_sq``) can
    underflow to zero; 'bf16' keeps float32's range."""
    average_optimizer_state: bool = True
    """Average the optimizer state across nodes in every cycling epoch's closing sync, so every epoch
    ends with one optimizer state (checkpoints and resumes are the same from any rank). With Adam
    that sync then carries two float32 moments per parameter: five times the bytes of the fp16
    parameters. False keeps each node's own state between cycling epochs (the reference
    implementation never averages it); it is still averaged before a warmup or cooldown epoch, so
    their steps stay bit-identical on every worker. A checkpoint then holds rank 0's node's state."""
    cycling: Cycling = "auto"
    """``"auto"``: at the end of the first cycling epoch, compare its steps (the closing sync included)
    with the synchronous epochs' steps, mean over workers; when cycling was more than 5 % slower (a
    fast link, where its extra collective rounds cost more than the bytes they save), every later
    epoch averages the gradients over all workers, as warmup does, and rank 0 says so. Needs a warmup
    epoch to compare with. ``"always"``: cycle whenever the schedule says (the reference's DASO)."""
    verbose: bool = False
    """Print schedule changes on rank 0."""

    def __post_init__(self) -> None:
        for name in ("average_optimizer_state", "downcast_optimizer_state", "verbose"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DasoConfig.{name}={getattr(self, name)!r} must be True or False")
        for name in ("warmup_epochs", "cooldown_epochs", "stable_epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"DasoConfig.{name}={getattr(self, name)!r} must be >= 0")
        for name in (
            "max_global_skips",
            "skip_reduction_factor",
            "local_skip_factor",
            "sending_chunk_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"DasoConfig.{name}={getattr(self, name)!r} must be >= 1")
        if self.skip_reduction_factor < 2:
            raise ValueError(f"DasoConfig.skip_reduction_factor={self.skip_reduction_factor!r} must be >= 2")
        if not 0 <= self.stability_level < 1:
            raise ValueError(f"DasoConfig.stability_level={self.stability_level!r} must be in [0, 1)")
        if self.cycling not in CYCLING_CHOICES:
            raise ValueError(
                f"DasoConfig.cycling={self.cycling!r} is not supported; choose one of {list(CYCLING_CHOICES)}"
            )
        if self.downcast not in DOWNCAST_TYPES:
            raise ValueError(
                f"DasoConfig.downcast={self.downcast!r} is not supported; choose one of {list(DOWNCAST_TYPES)}"
            )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_any(value: DasoConfig | dict[str, Any] | None) -> DasoConfig:
        """Accept a config, a dict of its fields (from YAML or flags) or None for the defaults."""
        if value is None:
            return DasoConfig()
        if isinstance(value, DasoConfig):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(DasoConfig)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown DASO setting(s) {unknown}; known settings are {sorted(known)}")
            return DasoConfig(**value)
        raise TypeError(f"daso={value!r} must be a DasoConfig, a dict of its fields, or None")
