"""``Trainer(strategy="horovod")`` and ``Fabric(strategy="horovod")`` in Slurm: HorovodEnvironment from the start.

Lightning's connectors (the Trainer's and Fabric's) choose a cluster environment before they build
a strategy named by a string, and under Slurm they construct SLURMEnvironment, which refuses a job
written with ``#SBATCH --ntasks=N`` ("use --ntasks-per-node"). Horovod takes its ranks from its
launcher (PMIx/MPI or horovodrun), so that refusal does not apply. A strategy instance carries
HorovodEnvironment and Lightning keeps it; this gives the registered names the same, and leaves
every other strategy's choice to Lightning.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment

from hvd_plugins.fabric.lightning_internals import override_cluster_environment_choice
from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment


def choose_horovod_environment_for(names: Collection[str], connector: type) -> None:
    """Make ``connector`` pick HorovodEnvironment when the strategy flag is one of ``names`` (idempotent)."""

    def horovod_for_these_names(strategy: Any, environment: Any) -> ClusterEnvironment | None:
        if strategy in names and not isinstance(environment, ClusterEnvironment):
            return HorovodEnvironment()
        return None  # another strategy, or an environment the user gave: Lightning decides

    override_cluster_environment_choice(connector, horovod_for_these_names)
