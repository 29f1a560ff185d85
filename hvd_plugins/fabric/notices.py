"""What Lightning prints that does not concern the user of a Horovod job, kept off the console.

- ``Seed set to N``: every worker logs it, with no rank to tell them apart; only rank 0 does here.
- The "Tip" lines advertising Lightning's hosted logging and model services.
- Under horovodrun or mpirun, the hint to launch with ``srun``: a launcher did start the workers.
- Lightning's own use of torch's deprecated ``LeafSpec`` (torch 2.13), which no user can act on.

Set ``HVD_PLUGINS_ALL_NOTICES=1`` to see them all, as without this package.
"""

from __future__ import annotations

import logging
import os
import warnings

from hvd_plugins.core.backend.launch_env import launcher_rank

ALL_NOTICES_ENV = "HVD_PLUGINS_ALL_NOTICES"
SEED_LOGGER = "lightning.fabric.utilities.seed"
RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"
TIP_PREFIX = "\N{ELECTRIC LIGHT BULB} Tip:"
SRUN_HINT = r"The `srun` command is available on your system but is not used"
LEAF_SPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _DropNotices(logging.Filter):
    """Drops the seed message on ranks other than 0, and the tips on every rank."""

    def __init__(self, drop_seed: bool) -> None:
        super().__init__()
        self.drop_seed = drop_seed

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == SEED_LOGGER:
            return not self.drop_seed
        return not record.getMessage().startswith(TIP_PREFIX)


def quiet_lightning_notices() -> None:
    """At a face's import: filter the notices above (idempotent)."""
    if os.environ.get(ALL_NOTICES_ENV) == "1":
        return
    rank = launcher_rank()
    for name in (SEED_LOGGER, RANK_ZERO_LOGGER):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropNotices) for existing in logger.filters):
            logger.addFilter(_DropNotices(drop_seed=rank is not None and rank > 0))
    warnings.filterwarnings("ignore", message=LEAF_SPEC_DEPRECATION)
    if rank is not None:
        warnings.filterwarnings("ignore", message=SRUN_HINT)
