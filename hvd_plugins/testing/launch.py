"""Launch real Horovod jobs from a driver process, bounded in time, and collect what each rank wrote.

Used by the multi-process tests and by the benchmarks. A worker writes ``rank<N>.json`` into the
``--out`` folder it is given; the launcher appends ``--out`` and reads those files back. Only
the standard library is imported here, so a driver stays light.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIMEOUT_EXIT_CODE = 124
GLOO_TIMEOUT_SECONDS = "180"
"""Horovod's default of 30 s to start every worker is too short on a loaded machine."""
LAUNCHER_ENV_PREFIXES = ("HOROVOD_", "OMPI_", "PMI_")
LAUNCH_LOG_ENV = "HVD_LAUNCH_LOG"
"""A file to which every ``run_bounded`` launch appends a line: the test file that launched it (under
pytest), the command, and its seconds. Counts where a suite's time goes; unset, nothing is written."""


class JobFailed(RuntimeError):
    """A launched job exited non-zero or outlived its time limit."""


@dataclass
class JobResult:
    """What a launched job left behind; ``results`` maps rank to the JSON it wrote."""

    returncode: int
    output: str
    seconds: float
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    timed_out: bool = False

    def check(self, what: str = "horovodrun") -> JobResult:
        """Raise JobFailed with the tail of the job's output when it failed."""
        if self.returncode != 0:
            raise JobFailed(f"{what} failed with exit code {self.returncode}:\n{self.output[-6000:]}")
        return self


def sibling_tool(name: str) -> str:
    """The console script ``name`` of this interpreter's environment, else ``name`` on PATH."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def horovodrun_path() -> str:
    return sibling_tool("horovodrun")


UNPROBED_HOROVODRUN = Path(__file__).with_name("horovodrun_unprobed.py")


@functools.cache
def require_gloo_build() -> None:
    """Check once per driver process that Horovod was built with Gloo, as horovodrun does per launch.

    Asks the already imported ``horovod.torch`` when there is one; otherwise Horovod's own probe
    runs (a forked process imports it), once.
    """
    if "horovod.torch" in sys.modules:
        built = bool(sys.modules["horovod.torch"].gloo_built())
    else:
        from horovod.common.util import gloo_built

        built = bool(gloo_built())
    if not built:
        raise JobFailed("this Horovod build has no Gloo support; reinstall it with HOROVOD_WITH_GLOO=1")


@functools.cache
def mpi_launch_problem() -> str | None:
    """Why ``horovodrun --mpi`` cannot run here (no mpirun, or Horovod built without MPI); None when it can."""
    if shutil.which("mpirun") is None:
        return "mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)"
    if "horovod.torch" in sys.modules:
        built = bool(sys.modules["horovod.torch"].mpi_built())
    else:
        from horovod.common.util import mpi_built

        built = bool(mpi_built())
    return None if built else "this Horovod build has no MPI controller (rebuild with: hvd-build-horovod --mpi yes)"


def horovodrun_command(probe_build: bool = False, controller: str = "gloo") -> list[str]:
    """How to start horovodrun: the console script, or (``probe_build=False``) Horovod's same entry
    point run without the build probe each launch pays for, once the build was checked here."""
    if probe_build:
        return [horovodrun_path()]
    if controller == "mpi":
        problem = mpi_launch_problem()
        if problem is not None:
            raise JobFailed(problem)
    else:
        require_gloo_build()
    return [sys.executable, str(UNPROBED_HOROVODRUN)]


def read_rank_files(out_dir: Path) -> dict[int, dict[str, Any]]:
    return {int(path.stem[4:]): json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))}


def write_rank_file(out_dir: Path, rank: int, data: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(data, default=float))


def run_bounded(
    command: Sequence[str],
    timeout: float,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    out_dir: Path | None = None,
    drop_launcher_env: bool = False,
) -> JobResult:
    """Run ``command`` in its own process group; kill the whole group when it outlives ``timeout``.

    Killing the group, not just the launcher, keeps a hung worker from outliving the driver.
    ``env`` is added to this process's environment (unbuffered, warnings off); with
    ``drop_launcher_env`` Horovod/MPI variables are removed so a plain process runs alone.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    if drop_launcher_env:
        full_env = {name: value for name, value in full_env.items() if not name.startswith(LAUNCHER_ENV_PREFIXES)}
    start = time.monotonic()
    process = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        returncode, timed_out = process.returncode, False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\n[killed after {timeout:.0f}s]"
        returncode, timed_out = TIMEOUT_EXIT_CODE, True
    results = read_rank_files(out_dir) if out_dir is not None else {}
    seconds = time.monotonic() - start
    _log_launch(command, seconds)
    return JobResult(returncode, output, seconds, results, timed_out)


def _log_launch(command: Sequence[str], seconds: float) -> None:
    """One line in ``HVD_LAUNCH_LOG`` (when set): ``test file<TAB>program and first argument<TAB>seconds``."""
    log = os.environ.get(LAUNCH_LOG_ENV)
    if not log:
        return
    test_file = os.environ.get("PYTEST_CURRENT_TEST", "-").split("::")[0]
    with open(log, "a") as file:
        file.write(f"{test_file}\t{' '.join(Path(part).name for part in command[:2])}\t{seconds:.1f}\n")


def horovodrun(
    worker: Sequence[str],
    *,
    np: int = 2,
    hosts: str | None = None,
    out_dir: Path | None = None,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    probe_build: bool = False,
    controller: str = "gloo",
) -> JobResult:
    """``horovodrun -np N -H hosts --gloo <worker> [--out out_dir]``, bounded by ``timeout``.

    ``controller="mpi"`` launches with ``--mpi`` instead (OpenMPI's mpirun; as root with the two
    variables OpenMPI asks for, and ranks that yield their core while they wait).

    ``worker`` is the full worker command (e.g. ``[sys.executable, script, *args]``); ``hosts``
    defaults to ``localhost:N``. ``HOROVOD_GLOO_TIMEOUT_SECONDS`` defaults to 180 s unless this
    process's environment or ``env`` sets it. horovodrun's per-launch build probe is skipped
    unless ``probe_build`` (see ``horovodrun_command``).
    """
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller={controller!r}; choose 'gloo' or 'mpi'")
    launcher = horovodrun_command(probe_build, controller)
    command = [*launcher, "-np", str(np), "-H", hosts or f"localhost:{np}", f"--{controller}", *worker]
    if out_dir is not None:
        command += ["--out", str(out_dir)]
    full_env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", GLOO_TIMEOUT_SECONDS)}
    full_env.update(_mpi_env(env) if controller == "mpi" else (env or {}))
    return run_bounded(command, timeout, env=full_env, cwd=cwd, out_dir=out_dir)


def elastic_horovodrun(
    worker: Sequence[str],
    *,
    np: int,
    min_np: int,
    max_np: int,
    discovery_script: Path,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    runner_args: Sequence[str] = (),
) -> JobResult:
    """``horovodrun -np N --min-np A --max-np B --host-discovery-script S [runner_args] <worker>``: an elastic
    Gloo job.

    Its hosts are what ``discovery_script`` prints, and may change while the job runs. ``runner_args`` are
    more horovodrun options (``--elastic-timeout 20``).
    """
    command = elastic_horovodrun_command(worker, np, min_np, max_np, discovery_script, runner_args)
    return run_bounded(command, timeout, env=elastic_env(env), cwd=cwd)


def elastic_horovodrun_command(
    worker: Sequence[str], np: int, min_np: int, max_np: int, discovery_script: Path, runner_args: Sequence[str] = ()
) -> list[str]:
    """The command ``elastic_horovodrun`` runs, for a driver that starts it itself (to signal it, say)."""
    return [
        *horovodrun_command(),
        "-np", str(np), "--min-np", str(min_np), "--max-np", str(max_np),
        "--host-discovery-script", str(discovery_script), *runner_args, *worker,
    ]  # fmt: skip


def elastic_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What ``elastic_horovodrun`` adds to this process's environment: Gloo's start-up timeout, then ``env``."""
    timeout = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", GLOO_TIMEOUT_SECONDS)
    return {"HOROVOD_GLOO_TIMEOUT_SECONDS": timeout, **(env or {})}


MPI_RANKS_SHARE_CORES = {"OMPI_MCA_mpi_yield_when_idle": "1"}
"""OpenMPI busy-polls while a rank waits in MPI; with more ranks than cores (every job these helpers
start on a small host) the polling ranks take the CPU from those computing. Yielding took the suite's
two-node MPI job (4 ranks, 2 cores) from 42 s to 18 s. A variable already set wins."""


def _mpi_env(env: Mapping[str, str] | None) -> dict[str, str]:
    shared = {name: value for name, value in MPI_RANKS_SHARE_CORES.items() if name not in os.environ}
    if os.geteuid() == 0:
        shared.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return {**shared, **(env or {})}


MPIRUN_EXPORTS = ("PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONWARNINGS", "VIRTUAL_ENV", "OMP_NUM_THREADS")
"""Variables mpirun forwards to every worker (``-x``), on top of the HOROVOD_* ones of the launch."""


def mpirun(
    worker: Sequence[str],
    *,
    np: int = 2,
    hosts: str | None = None,
    out_dir: Path | None = None,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    mpi_args: Sequence[str] = (),
) -> JobResult:
    """``mpirun -np N [--host hosts] <worker> [--out out_dir]``: OpenMPI starts the workers, no horovodrun.

    Every ``HOROVOD_*`` variable of this process or ``env`` is forwarded, with the ones named in
    MPIRUN_EXPORTS. ``mpi_args`` go before the worker (``--mca plm_rsh_agent ...`` and the like).
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", **_mpi_env(env)}
    exports = [name for name in full_env if name in MPIRUN_EXPORTS or name.startswith("HOROVOD_")]
    command = [shutil.which("mpirun") or "mpirun", "-np", str(np), "--bind-to", "none", "--tag-output"]
    if hosts:
        command += ["--host", hosts]
    for name in sorted(exports):
        command += ["-x", name]
    command += [*mpi_args, *worker]
    if out_dir is not None:
        command += ["--out", str(out_dir)]
    return run_bounded(command, timeout, env=full_env, cwd=cwd, out_dir=out_dir)
