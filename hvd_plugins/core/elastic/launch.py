"""Whether a fit runs elastically: asked for by ``elastic=``, possible only under an elastic horovodrun."""

from __future__ import annotations

from hvd_plugins.core.backend.elastic import elastic_launch
from hvd_plugins.core.backend.launch_env import launched_by_launcher
from hvd_plugins.core.config import HorovodConfig

ELASTIC_COMMAND = "horovodrun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./discover_hosts.sh python train.py"


def runs_elastic(config: HorovodConfig) -> bool:
    """``elastic="auto"``: whether horovodrun started an elastic job; True/False must match the launch."""
    launched = elastic_launch()
    if config.elastic == "auto":
        wanted = launched
    elif config.elastic and not launched:
        how = (
            "was started by another launcher (mpirun, srun or horovodrun without --host-discovery-script)"
            if (launched_by_launcher())
            else "runs without horovodrun"
        )
        raise ValueError(
            f"elastic=True, but this worker {how}. Elastic Horovod needs its driver, which only horovodrun with "
            f"the Gloo controller starts: `{ELASTIC_COMMAND}`. Leave elastic='auto' to run either way."
        )
    elif not config.elastic and launched:
        raise ValueError(
            "elastic=False, but horovodrun started an elastic job (--host-discovery-script): its driver would "
            "start and drop workers this fit cannot take in. Use elastic='auto', or launch without "
            "--host-discovery-script."
        )
    else:
        wanted = bool(config.elastic)
    if wanted and config.op == "adasum":
        raise ValueError(
            "op='adasum' does not work in an elastic job: Adasum needs Horovod's MPI controller and elastic "
            "Horovod runs only with the Gloo controller; use op='average'"
        )
    return wanted
