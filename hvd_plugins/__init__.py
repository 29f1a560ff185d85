"""Horovod as a first-class way to train with Lightning 2.x.

``import hvd_plugins`` registers the strategy names ``"horovod"``, ``"horovod_fp16"``,
``"horovod_hierarchical"`` and ``"horovod_daso"`` with the Trainer of every Lightning package
installed: ``lightning`` (``lightning.pytorch``) and ``pytorch_lightning``. Classes for a Trainer
come from its face: ``hvd_plugins.pytorch`` for ``lightning.pytorch`` (also importable from here),
``hvd_plugins.pytorch_lightning`` for ``pytorch_lightning``, files generated from the first at build
time (``hvd_plugins.mirror``). ``hvd_plugins.core`` holds what needs no Lightning.
"""

import logging
from importlib.util import find_spec
from typing import TYPE_CHECKING

from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.faults.finite import NonFiniteGradientError
from hvd_plugins.core.faults.preemption import note_early_warning_signal
from hvd_plugins.core.sync.daso.config import DasoConfig

__version__ = "0.4.0"


class _FallbackStderrHandler(logging.StreamHandler):
    """Prints the package's reports only while the root logger has no handler of its own.

    Records still propagate, so an application that configures logging later (or pytest's
    ``caplog``) receives them, and they are not printed twice.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().hasHandlers():
            super().emit(record)


def _log_to_stderr() -> None:
    """Library messages (route choices, failure reports) reach stderr unless the application configured logging."""
    logger = logging.getLogger("hvd_plugins")
    if logger.handlers or logging.getLogger().hasHandlers():
        return
    handler = _FallbackStderrHandler()
    handler.setFormatter(logging.Formatter("hvd_plugins: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _generated_face_missing(error: ModuleNotFoundError) -> ImportError:
    """In a source tree that was never installed, the generated faces do not exist yet: say how to make them."""
    return ImportError(
        f"{error.name} is generated from hvd_plugins/pytorch when the package is built or installed, and is "
        "missing here: run `pip install -e .` (or `python hvd_plugins/mirror.py`) in the source tree"
    )


_log_to_stderr()
note_early_warning_signal()  # in a Slurm job: a time-limit warning during start-up is kept, not fatal

if TYPE_CHECKING or find_spec("lightning") is not None:
    from hvd_plugins.pytorch import AtomicCheckpointIO, HorovodEnvironment, HorovodStrategy, HorovodSyncBatchNorm

    if find_spec("pytorch_lightning") is not None:
        try:
            import hvd_plugins.pytorch_lightning  # noqa: F401  (registers the names with its Trainer)
        except ModuleNotFoundError as error:
            if not (error.name or "").startswith("hvd_plugins."):
                raise
            raise _generated_face_missing(error) from error
else:  # only pytorch_lightning is installed: the top-level names are its face's (type checkers see the other)
    try:
        from hvd_plugins.pytorch_lightning import (
            AtomicCheckpointIO,
            HorovodEnvironment,
            HorovodStrategy,
            HorovodSyncBatchNorm,
        )
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("hvd_plugins."):
            raise
        raise _generated_face_missing(error) from error

__all__ = [
    "AtomicCheckpointIO",
    "CommCounters",
    "DasoConfig",
    "HorovodConfig",
    "HorovodEnvironment",
    "HorovodStrategy",
    "HorovodSyncBatchNorm",
    "NonFiniteGradientError",
    "__version__",
]
