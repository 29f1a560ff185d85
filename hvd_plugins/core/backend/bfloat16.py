"""Whether the installed Horovod can send bfloat16 tensors, and the error that says how to get one.

Horovod 0.28.1 knows no bfloat16: its torch extension has no binding for ``torch.BFloat16Tensor``,
so any collective on one fails deep inside Horovod. ``hvd-build-horovod`` applies the patches
``0012`` to ``0015`` of ``hvd_plugins/build/patches/``, which add bfloat16 to Horovod's wire
messages, its torch extension, and its Gloo, MPI and NCCL operations. The check asks the extension
itself, so a build that got bfloat16 another way counts too.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch.nn import Module

from hvd_plugins.core.backend.build_marker import applied_patches
from hvd_plugins.core.backend.module import BUILD_COMMAND, horovod_torch

BFLOAT16_PATCH = "0012-bfloat16-data-type"
"""The first patch of the bfloat16 series, as ``applied_patches`` names it."""
_BINDING = "horovod_torch_allreduce_async_torch_BFloat16Tensor"


class BFloat16Unsupported(RuntimeError):
    """The installed Horovod cannot send bfloat16; says what asked for it and the command that fixes it."""


def takes_bfloat16(hvd: ModuleType) -> bool:
    """True when ``hvd`` (``horovod.torch``) has the bfloat16 collectives in its torch extension."""
    return hasattr(getattr(hvd, "mpi_lib_v2", None), _BINDING)


def horovod_takes_bfloat16() -> bool:
    """True when the installed Horovod can send bfloat16 (raises HorovodUnavailable without one)."""
    return takes_bfloat16(horovod_torch())


def _what_the_build_is() -> str:
    patches = applied_patches()
    if not patches:
        return "it was not built by hvd-build-horovod: no patch marker beside horovod/__init__.py"
    return f"it was built by hvd-build-horovod with patches {', '.join(sorted(p[:4] for p in patches))}"


def require_bfloat16(what: str, hvd: ModuleType | None = None) -> None:
    """Raise BFloat16Unsupported naming ``what`` (e.g. ``"compression='bf16'"``) and the build command,
    unless ``hvd`` (default: the installed ``horovod.torch``) can send bfloat16."""
    if takes_bfloat16(hvd if hvd is not None else horovod_torch()):
        return
    raise BFloat16Unsupported(
        f"{what} sends bfloat16 tensors through Horovod, but the installed Horovod cannot "
        f"({_what_the_build_is()}; Horovod 0.28.1 has no bfloat16). Run `{BUILD_COMMAND}`: it builds "
        f"Horovod with the bfloat16 patches ({BFLOAT16_PATCH} and the three after it) and installs it. "
        "Without it, use precision='bf16-mixed' (float32 weights and gradients) or compression='fp16'."
    )


def require_bfloat16_for(module: Module, hvd: ModuleType | None = None) -> None:
    """Raise BFloat16Unsupported before the first collective when ``module`` holds bfloat16 tensors
    (``precision='bf16-true'``, or a model cast with ``.to(torch.bfloat16)``) and Horovod cannot send them."""
    tensors = [*module.parameters(), *module.buffers()]
    if any(tensor.dtype == torch.bfloat16 for tensor in tensors):
        require_bfloat16("A model with bfloat16 parameters (precision='bf16-true')", hvd)
