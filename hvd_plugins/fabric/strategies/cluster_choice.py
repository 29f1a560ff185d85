"""``Trainer(strategy="horovod")`` and ``Fabric(strategy="horovod")`` in Slurm: HorovodEnvironment from the start.

Lightning's connectors (the Trainer's and Fabric's) choose a cluster environment before they build
a strategy named by a string, and under Slurm they construct SLURMEnvironment, which refuses a job
written with ``#SBATCH --ntasks=N`` ("use --ntasks-per-node"). Horovod takes its ranks from its
launcher (PMIx/MPI or horovodrun), so that refusal does not apply. A strategy instance carries
HorovodEnvironment and Lightning keeps it; this gives the registered names the same, and leaves
every other strategy's choice to Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment

from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment

MARK = "_hvd_plugins_names"


def choose_horovod_environment_for(names: Collection[str], connector: Any) -> None:
    """Make ``connector`` pick HorovodEnvironment when the strategy flag is one of ``names`` (idempotent)."""
    original: Callable[[Any], ClusterEnvironment] | None = getattr(
        connector, "_choose_and_init_cluster_environment", None
    )
    if original is None or hasattr(original, MARK):
        return

    def choose(self: Any) -> ClusterEnvironment:
        chosen = getattr(self, "_cluster_environment_flag", None)
        if getattr(self, "_strategy_flag", None) in names and not isinstance(chosen, ClusterEnvironment):
            return HorovodEnvironment()
        return original(self)

    setattr(choose, MARK, frozenset(names))
    connector._choose_and_init_cluster_environment = choose
