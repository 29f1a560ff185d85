"""One place that imports ``horovod.torch``, so a missing or broken build fails with advice."""

from __future__ import annotations

from types import ModuleType

_INSTALL_HINT = (
    "hvd_plugins needs Horovod built with PyTorch support for the torch in this environment. "
    "Build and install it with `bash ci/install_horovod.sh` (see README.rst)."
)


def horovod_torch() -> ModuleType:
    """Return ``horovod.torch``, raising an ImportError that says how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as error:  # the wheel is missing, or was built for another torch
        raise ImportError(f"{_INSTALL_HINT} (import failed: {error})") from error
    return hvd
