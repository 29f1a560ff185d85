"""One place that imports ``horovod.torch``, so a missing or broken build fails with advice."""

from __future__ import annotations

from types import ModuleType

BUILD_COMMAND = "hvd-build-horovod"
"""Installed with this package (``python -m hvd_plugins.build`` is the same)."""


class HorovodUnavailable(ImportError):
    """Horovod is missing, or installed without PyTorch support; says the command that fixes it."""


def _advice(problem: str) -> str:
    return (
        f"{problem}. hvd_plugins needs Horovod built with PyTorch support for the torch in this environment; "
        f"run `{BUILD_COMMAND}` (it builds Horovod 0.28.1 for this torch, caches the wheel and installs it; "
        f"`{BUILD_COMMAND} --help` lists its options, e.g. --mpi yes or --gpu nccl)."
    )


def horovod_torch() -> ModuleType:
    """Return ``horovod.torch``, raising HorovodUnavailable with the command to run when it cannot train."""
    try:
        import horovod.torch as hvd
    except ImportError as error:  # the wheel is missing, or was built for another torch
        raise HorovodUnavailable(_advice(f"Horovod cannot be imported ({error})")) from error
    if not getattr(hvd, "_MPI_LIB_AVAILABLE", True) or not hasattr(hvd, "is_initialized"):
        # pip builds horovod from its sdist without torch: the package imports, its PyTorch extension is absent
        raise HorovodUnavailable(_advice("The installed Horovod was built without PyTorch support"))
    return hvd
