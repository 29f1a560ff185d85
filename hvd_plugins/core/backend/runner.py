"""``python train.py`` with ``Trainer(strategy="horovod", devices=N)`` starts its N workers itself.

Lightning's DDP re-runs the script once per extra device; this does the same through Horovod's own
runner, as ``horovodrun -np N -H localhost:N --gloo`` does on one machine: the process the user
started runs Horovod's rendezvous server with the host allocation plan, becomes rank 0, and re-runs
the script N-1 times with the variables horovodrun gives each worker. The re-run scripts see those
variables and behave exactly as under horovodrun. Several machines stay horovodrun's job (``-H`` or
a hosts file): one plain process cannot start workers on other hosts.

Failures end the whole job, as with horovodrun: at the first worker that exits non-zero the others
get SIGTERM, then SIGKILL after 5 s, and this process exits non-zero, naming that worker's rank.
Workers die with this process (Linux parent-death signal), so a killed rank 0 leaves none behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hvd_plugins.core.backend.launch_env import launched_by_launcher
from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.rendezvous import LOOPBACK, rendezvous_arrivals, start_loopback_rendezvous

log = logging.getLogger(__name__)

HOSTNAME = "localhost"
"""The host name horovodrun gives the workers of ``-H localhost:N``; it names the node-local rendezvous scope."""
POLL_SECONDS = 0.2
TERMINATE_GRACE_SECONDS = 5.0
"""Between SIGTERM and SIGKILL, as horovodrun: a worker stuck in a collective ignores SIGTERM."""
EXIT_GRACE_SECONDS = 15.0
"""How long rank 0 may keep running after a worker failed before it is ended as well."""
_DIE_WITH_PARENT = Path(__file__).with_name("die_with_parent.py")


class WorkerFailedError(RuntimeError):
    """A worker this process started ended before every worker had joined Horovod."""


def script_command() -> list[str]:
    """The command that started this process, to run it again for each worker (as Lightning's DDP does)."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None:  # python -m package.module
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or not os.path.isfile(script):
        raise RuntimeError(
            f"Trainer(strategy='horovod', devices=N) re-runs the script for every worker, but this process was "
            f"not started from a script file (sys.argv[0]={script!r}). Put the code in a file and run "
            "`python train.py`, or start the workers with `horovodrun -np N python train.py`."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


def local_launch_size(devices: Sequence[torch.device], num_nodes: int, front: str = "Trainer") -> int:
    """How many workers this process must start itself: 0 when a launcher did, Horovod runs, or one device.

    Checked when the Trainer (or Fabric, ``front``) is built, so what a plain process cannot launch fails first.
    """
    if len(devices) < 2 or launched_by_launcher() or horovod_torch().is_initialized():
        return 0
    if num_nodes > 1:
        raise ValueError(
            f"{front}(num_nodes={num_nodes}) needs horovodrun, which starts the workers on every host: "
            "`horovodrun -np 8 -H node1:4,node2:4 python train.py` (or `-hostfile hosts`). A plain "
            "`python train.py` starts its workers on this machine only."
        )
    if devices[0].type == "cuda" and [device.index for device in devices] != list(range(len(devices))):
        raise ValueError(
            f"A plain python launch puts worker i on cuda:i, but the {front} asked for {list(map(str, devices))}. "
            "Choose the GPUs with CUDA_VISIBLE_DEVICES and pass devices=<count>."
        )
    script_command()
    return len(devices)


class LocalJob:
    """Workers 1..N-1 started by this process, the rendezvous server they meet at, and their end."""

    def __init__(self, size: int) -> None:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
        from horovod.runner.util.network import get_local_intfs

        command = script_command()
        nics = get_local_intfs()  # the interfaces holding 127.0.0.1, which horovodrun picks for local hosts
        if not nics:
            raise RuntimeError("No network interface holds 127.0.0.1, which the workers of this machine meet on.")
        self.failure: str | None = None
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self._stopped: set[int] = set()  # ranks this process terminated: their status is no failure of theirs
        self._lock = threading.Lock()
        self.server, port = start_loopback_rendezvous()  # the workers are on this machine: nothing else may reach it
        plan = get_host_assignments(parse_hosts(f"{HOSTNAME}:{size}"), size)
        self.server.init(plan)
        job_env = {name: str(value) for name, value in create_run_env_vars(LOOPBACK, nics, port).items()}
        guard = [sys.executable, "-I", "-S", str(_DIE_WITH_PARENT), str(os.getpid())]  # -I -S: stdlib only, fast
        try:
            for slot in plan[1:]:
                env = {**os.environ, **job_env, **create_slot_env_vars(slot), "PYTHONUNBUFFERED": "1"}
                self.workers[slot.rank] = subprocess.Popen([*guard, *command], env=env)
        except BaseException:
            self.stop_workers()
            self.server.stop()
            raise
        os.environ.update({**job_env, **create_slot_env_vars(plan[0])})  # this process is rank 0
        atexit.register(self.finish)  # before hvd.init registers its shutdown, so this runs after it
        threading.Thread(target=self._watch, name="hvd_plugins-workers", daemon=True).start()

    def wait_for_workers(self) -> None:
        """Return once every worker has reached ``hvd.init()``.

        The workers import and build their data before they get there, which rank 0 has done already;
        starting rank 0's Gloo timeout only now keeps a slow start from timing out.
        """
        while True:
            arrived = rendezvous_arrivals(self.server)
            if self.workers.keys() <= arrived:
                return
            gone = [rank for rank, worker in self.workers.items() if rank not in arrived and worker.poll() is not None]
            if gone:
                self._record(gone[0], " before it reached hvd.init()")
                self.stop_workers()
            if self.failure is not None:
                raise WorkerFailedError(self.failure)
            time.sleep(POLL_SECONDS)

    def kill(self, signum: int) -> None:
        """Pass a signal Lightning received on to the workers."""
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signum)

    def stop_workers(self) -> None:
        """SIGTERM every running worker, then SIGKILL those left after the grace period."""
        with self._lock:
            running = {rank: process for rank, process in self.workers.items() if process.poll() is None}
            self._stopped.update(running)
        for process in running.values():
            process.send_signal(signal.SIGTERM)
        self._wait(TERMINATE_GRACE_SECONDS)
        for process in running.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    def finish(self) -> None:
        """At exit: wait for the workers (stop them if this process failed); exit non-zero if one failed."""
        failing = getattr(sys, "last_value", None) is not None  # set for an exception nobody caught
        if failing:
            self._wait(TERMINATE_GRACE_SECONDS)  # Horovod has shut down here: most workers end by themselves
            self.stop_workers()
        for process in self.workers.values():
            process.wait()
        self.server.stop()
        failed = [rank for rank, process in sorted(self.workers.items()) if process.returncode]
        failed = [rank for rank in failed if rank not in self._stopped]
        if failed:
            self._record(failed[0])
        if self.failure is not None and not failing:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # an exit handler cannot change the exit status otherwise

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for process in self.workers.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _watch(self) -> None:
        """End the job at the first worker that exits non-zero, as horovodrun does."""
        while self.failure is None and not self._stopped:
            codes = {rank: process.poll() for rank, process in self.workers.items()}
            failed = [rank for rank, code in codes.items() if code]
            if failed:
                if self._record(failed[0], suffix="; stopping the other workers"):
                    self.stop_workers()
                    deadline = threading.Timer(EXIT_GRACE_SECONDS, self._exit_now)
                    deadline.daemon = True
                    deadline.start()
                return
            if all(code == 0 for code in codes.values()):
                return
            time.sleep(POLL_SECONDS)

    def _record(self, rank: int, when: str = "", suffix: str = "") -> bool:
        """Keep and print the first failure; False when one was recorded already."""
        process = self.workers[rank]
        with self._lock:
            if self.failure is not None or rank in self._stopped:
                return False
            self.failure = f"worker rank {rank} (pid {process.pid}) exited with status {process.returncode}{when}"
        log.error(f"{self.failure}{suffix}")
        return True

    def _exit_now(self) -> None:
        log.error(f"rank 0 still runs {EXIT_GRACE_SECONDS:g} s after {self.failure}; ending it")
        os._exit(1)


_local_job: LocalJob | None = None
"""The one job this process started; it outlives Trainers and Fabrics (a later one sees the Horovod variables)."""


def start_local_job_once(size: int, start_horovod: Callable[[], Any], asked_as: str) -> None:
    """Start ``size`` workers of this script (once per process), then Horovod; ``asked_as`` names the request."""
    global _local_job
    if _local_job is None:
        if horovod_torch().is_initialized():
            raise RuntimeError(
                f"hvd.init() ran before the {size} workers of {asked_as} were started. "
                "Let the strategy start Horovod, or launch with `horovodrun`."
            )
        _local_job = LocalJob(size)
        _local_job.wait_for_workers()
    start_horovod()


def kill_local_job(signum: int) -> None:
    if _local_job is not None:
        _local_job.kill(signum)
