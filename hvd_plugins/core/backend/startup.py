"""Starting Horovod with what the configuration needs; idempotent, so a script's own ``hvd.init()`` is kept."""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING

from hvd_plugins.core.backend.loop_cadence import choose_loop_cadence
from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.stall import apply_stall_timeout

if TYPE_CHECKING:
    from hvd_plugins.core.config import HorovodConfig

NATIVE_HIERARCHICAL_ENV = "HOROVOD_HIERARCHICAL_ALLREDUCE"
log = logging.getLogger(__name__)


def init_horovod(config: HorovodConfig) -> ModuleType:
    """Start Horovod with what ``config`` needs (idempotent: a script's own ``hvd.init()`` is kept).

    Node-aware syncs need no process sets (``comm.partners``), so Horovod is started plainly and
    never restarted; only Horovod's native hierarchical allreduce is switched on before the start,
    and the loop's idle cadence chosen (``loop_cadence``).
    """
    hvd = horovod_torch()
    apply_stall_timeout(config.stall_timeout_seconds, horovod_initialized=hvd.is_initialized())
    if not hvd.is_initialized():
        if config.native_hierarchical:
            os.environ[NATIVE_HIERARCHICAL_ENV] = "1"
        cadence = choose_loop_cadence()
        hvd.init()
        if hvd.rank() == 0:
            log.info(cadence)
    return hvd
