"""Launch real Horovod jobs from pytest and collect what each rank reported.

Thin test-side names over ``hvd_plugins.testing.launch``: worker scripts are looked up in
``tests/workers`` and a job that outlives its timeout fails the test. ``lightning="pytorch_lightning"``
runs the same worker written for ``pytorch_lightning``: a copy of ``tests/workers`` whose imports
say ``import pytorch_lightning as pl`` and ``from hvd_plugins.pytorch_lightning import ...``, made
with the rewrite that builds the package's own ``pytorch_lightning`` face.
"""

from __future__ import annotations

import atexit
import functools
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from hvd_plugins.mirror import rewrite
from hvd_plugins.testing.launch import JobResult, horovodrun, horovodrun_path, mpirun, run_bounded
from hvd_plugins.testing.netns_cluster import NamespaceCluster

__all__ = [
    "LIGHTNING_PACKAGES",
    "REPO",
    "TWO_NODES",
    "WORKERS",
    "JobResult",
    "horovodrun_path",
    "run_job",
    "run_mpirun",
    "run_on_mpi_nodes",
    "run_single",
    "scripts_for",
    "workers_for",
]

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
TWO_NODES = "localhost:2,127.0.0.1:2"  # one machine, two emulated nodes of two workers
LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


@functools.cache
def scripts_for(folder: Path, lightning: str) -> Path:
    """The scripts (and YAML configs) of ``folder`` as written for ``lightning``; ``folder`` itself for
    ``lightning.pytorch``, a rewritten copy for ``pytorch_lightning``."""
    if lightning == "lightning.pytorch":
        return folder
    if lightning != "pytorch_lightning":
        raise ValueError(f"lightning={lightning!r}; choose one of {LIGHTNING_PACKAGES}")
    copy = Path(tempfile.mkdtemp(prefix=f"{folder.name}_pytorch_lightning_"))
    for source in [*folder.glob("*.py"), *folder.glob("*.yaml")]:
        (copy / source.name).write_text(rewrite(source.read_text()))
    return copy


def workers_for(lightning: str) -> Path:
    """The worker scripts as written for ``lightning``."""
    return scripts_for(WORKERS, lightning)


def _worker_path(script: str | Path, lightning: str = "lightning.pytorch") -> Path:
    script = Path(script)
    return script if script.is_absolute() else workers_for(lightning) / script


FORKSERVER = Path(__file__).resolve().with_name("forkserver.py")
FORKSERVERS = 2
"""Servers with different hash seeds; ranks go to them in turn (tests/forkserver.py)."""


@functools.cache
def forkserver_env() -> dict[str, str]:
    """The variable that sends workers to this session's fork servers (tests/forkserver.py), started once.

    Workers it forks skip the ~5 s of CPU that importing torch, Lightning and Horovod costs each one
    (a server imports them once).
    Where it cannot start, the variable is left out and ``forkserver.py run`` starts plain workers.
    """
    folder = tempfile.mkdtemp(prefix="hvd_forkserver_")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONWARNINGS"}  # each worker sets its own
    seeds = random.sample(range(1, 2**32), FORKSERVERS)  # neighbouring ranks hash strings differently
    servers = {}
    for index, seed in enumerate(seeds):
        path = os.path.join(folder, f"socket{index}")
        servers[path] = subprocess.Popen(
            [sys.executable, str(FORKSERVER), "serve", path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**env, "PYTHONHASHSEED": str(seed)},
            start_new_session=True,
        )
        atexit.register(_stop_forkserver, servers[path])
    for server in servers.values():
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"ready":
            print(f"a fork server did not start (exit code {server.poll()}); workers start the plain way")
            return {}
    return {"HVD_TEST_FORKSERVER": os.pathsep.join(servers)}


def _stop_forkserver(server: subprocess.Popen) -> None:
    assert server.stdin is not None
    server.stdin.close()  # the server ends when its standard input does
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()


def _fail_on_timeout(job: JobResult, what: str, timeout: float) -> JobResult:
    if job.timed_out:
        raise AssertionError(f"{what} did not finish within {timeout}s:\n{job.output[-6000:]}")
    return job


def run_job(
    script: str | Path,
    *args: str,
    np: int = 2,
    hosts: str | None = None,
    out_dir: Path | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    python: bool = True,
    console_script: bool = False,
    lightning: str = "lightning.pytorch",
    controller: str = "gloo",
) -> JobResult:
    """Run ``horovodrun -np N -H hosts --gloo python script args`` and gather ``rank*.json``.

    The job runs in its own process group and is killed as a whole when it outlives
    ``timeout``, so a hang fails the test instead of blocking the suite. horovodrun's build
    probe, which costs seconds per launch, is skipped unless ``console_script`` asks for the
    ``horovodrun`` command itself.
    """
    script = _worker_path(script, lightning)
    worker = ([sys.executable, str(script)] if python else [str(script)]) + list(args)
    if python and controller == "gloo":
        worker[1:1] = [str(FORKSERVER), "run"]
        env = {**forkserver_env(), **(env or {})}
    job = horovodrun(
        worker,
        np=np,
        hosts=hosts,
        out_dir=out_dir,
        timeout=timeout,
        env=env,
        cwd=REPO,
        probe_build=console_script,
        controller=controller,
    )
    return _fail_on_timeout(job, "horovodrun", timeout)


def run_single(
    script: str | Path,
    *args: str,
    out_dir: Path | None = None,
    timeout: float = 300,
    lightning: str = "lightning.pytorch",
) -> JobResult:
    """Run a worker script as one plain python process (no launcher, no Horovod variables), from the fork server."""
    command = [sys.executable, str(FORKSERVER), "run", str(_worker_path(script, lightning)), *args]
    command += ["--out", str(out_dir)] if out_dir is not None else []
    job = run_bounded(command, timeout, env=forkserver_env(), cwd=REPO, out_dir=out_dir, drop_launcher_env=True)
    return _fail_on_timeout(job, "the single process", timeout)


def run_mpirun(
    script: str | Path, *args: str, np: int = 2, out_dir: Path | None = None, timeout: float = 300
) -> JobResult:
    """``mpirun -np N python script args`` on this machine: OpenMPI starts the workers, no horovodrun.

    The host is given N slots, so OpenMPI starts more workers than the machine has cores."""
    worker = [sys.executable, str(_worker_path(script)), *args]
    job = mpirun(worker, np=np, hosts=f"localhost:{np}", out_dir=out_dir, timeout=timeout, cwd=REPO)
    return _fail_on_timeout(job, "mpirun", timeout)


def run_on_mpi_nodes(
    cluster: NamespaceCluster,
    script: str | Path,
    *args: str,
    workers_per_node: int = 2,
    out_dir: Path,
    timeout: float = 300,
    lightning: str = "lightning.pytorch",
) -> JobResult:
    """``mpirun`` over the namespace cluster's nodes (each its own host to OpenMPI), through its rsh agent."""
    job = mpirun(
        [sys.executable, str(_worker_path(script, lightning)), *args],
        np=workers_per_node * cluster.nodes,
        hosts=cluster.mpi_hosts(workers_per_node),
        out_dir=out_dir,
        timeout=timeout,
        cwd=REPO,
        mpi_args=cluster.mpirun_args(out_dir),
    )
    return _fail_on_timeout(job, "mpirun on the namespace nodes", timeout)
