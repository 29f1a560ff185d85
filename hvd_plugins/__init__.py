"""Horovod as a first-class way to train with Lightning 2.x.

``import hvd_plugins`` registers the strategy names ``"horovod"``, ``"horovod_fp16"``,
``"horovod_hierarchical"`` and ``"horovod_daso"`` with the Trainer of every Lightning package
installed: ``lightning`` (``lightning.pytorch``) and ``pytorch_lightning``. Classes for a Trainer
come from its face: ``hvd_plugins.pytorch`` for ``lightning.pytorch`` (also importable from here),
``hvd_plugins.pytorch_lightning`` for ``pytorch_lightning``; both are built from one source
(``hvd_plugins.mirror``). ``hvd_plugins.core`` holds what needs no Lightning.
"""

import logging
from importlib.util import find_spec

from hvd_plugins import mirror
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.daso.config import DasoConfig
from hvd_plugins.core.faults.finite import NonFiniteGradientError
from hvd_plugins.core.faults.preemption import note_early_warning_signal

__version__ = "0.4.0"


def _log_to_stderr() -> None:
    """Library messages (route choices, failure reports) reach stderr unless the application configured logging."""
    logger = logging.getLogger("hvd_plugins")
    if logger.handlers or logging.getLogger().hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("hvd_plugins: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_log_to_stderr()
mirror.install()
note_early_warning_signal()  # in a Slurm job: a time-limit warning during start-up is kept, not fatal

if find_spec("lightning") is not None:
    from hvd_plugins.pytorch import AtomicCheckpointIO, HorovodEnvironment, HorovodStrategy, HorovodSyncBatchNorm

    if find_spec("pytorch_lightning") is not None:
        import hvd_plugins.pytorch_lightning  # noqa: F401  (registers the names with pytorch_lightning's Trainer)
else:
    from hvd_plugins.pytorch_lightning import (  # type: ignore[no-redef]
        AtomicCheckpointIO,
        HorovodEnvironment,
        HorovodStrategy,
        HorovodSyncBatchNorm,
    )

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
