"""A one-node Slurm (munge, slurmctld, slurmd) in a private folder, to run real batch jobs on one machine.

Used by the tests and handy for trying a batch script before a cluster sees it::

    python -m hvd_plugins.testing.slurm_cluster --cpus 4 -- sbatch --wait examples/slurm/train_mpi.sbatch

Needs root (slurmd runs jobs as their user) and Debian's ``slurm-wlm`` and ``munge`` packages.
Only the standard library is imported here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hvd_plugins.testing.launch import MPI_RANKS_SHARE_CORES

DAEMONS = ("munged", "slurmctld", "slurmd")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")


def slurm_problem() -> str | None:
    """Why a one-node Slurm cannot be started here; None when it can."""
    if os.geteuid() != 0:
        return "a one-node Slurm needs root (slurmd starts job steps as the job's user)"
    missing = [name for name in (*DAEMONS, "sbatch", "scontrol") if shutil.which(name) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    return None


def clear_stale_pmix_folders() -> None:
    """Slurm's PMIx plugin gives each step a folder ``/tmp/spmix_appdir_<uid>_<job>.<step>`` (its ``TmpFS``) that a
    killed step leaves behind. A new cluster numbers its jobs from 1 again, and a step that meets such a folder fails
    to launch ("Cannot create client cli tmpdir ... File exists"): remove them before it starts."""
    for stale in Path("/tmp").glob(f"spmix_appdir_{os.getuid()}_*"):
        shutil.rmtree(stale, ignore_errors=True)


def _slurm_conf(folder: Path, host: str, cpus: int) -> str:
    return "\n".join(
        [
            "ClusterName=hvdplugins",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"StateSaveLocation={folder}/state",
            f"SlurmdSpoolDir={folder}/spool",
            f"SlurmctldPidFile={folder}/slurmctld.pid",
            f"SlurmdPidFile={folder}/slurmd.pid",
            f"SlurmctldLogFile={folder}/slurmctld.log",
            f"SlurmdLogFile={folder}/slurmd.log",
            "SlurmctldPort=16817",
            "SlurmdPort=16818",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",  # CPUs below may exceed the cores: emulated workers share them
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=10",
            "MinJobAge=3600",  # finished jobs stay visible to scontrol for an hour
            "InactiveLimit=0",
            f"NodeName={host} CPUs={cpus} RealMemory=1000 State=UNKNOWN",
            "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ]
    )


class OneNodeSlurm:
    """Start munge (if not running), slurmctld and slurmd on this host; ``stop()`` ends what it started."""

    def __init__(self, cpus: int = 4, folder: Path | None = None) -> None:
        problem = slurm_problem()
        if problem:
            raise RuntimeError(problem)
        self.cpus = cpus
        self.folder = Path(folder or tempfile.mkdtemp(prefix="hvd_slurm_"))
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.folder / "slurm.conf"
        # Jobs take this environment: MPI ranks yield their core while they wait (MPI_RANKS_SHARE_CORES).
        self.env = {**MPI_RANKS_SHARE_CORES, **os.environ, "SLURM_CONF": str(self.conf)}
        self._started: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> OneNodeSlurm:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self, timeout: float = 90.0) -> None:
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_slurm_conf(self.folder, self.host, self.cpus))
        clear_stale_pmix_folders()
        self._start_munge()
        self._spawn(["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.scontrol("show", "node", self.host, check=False)
            if "State=IDLE" in state:
                return
            for process in self._started:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args!r} exited ({process.returncode}):\n{self.logs()}")
            time.sleep(1)
        raise RuntimeError(f"the Slurm node did not become idle in {timeout:.0f} s:\n{self.logs()}")

    def stop(self) -> None:
        for process in reversed(self._started):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
        self._started.clear()

    def scontrol(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True)
        if check and done.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout + done.stderr

    def sbatch(self, script: Path, *options: str, cwd: Path | None = None) -> int:
        """Submit ``script``; returns the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *options, str(script)],
            env=self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job_fields(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s Key=Value fields (JobState, Restarts, ExitCode, ...)."""
        text = self.scontrol("show", "job", str(job_id), check=False)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_for(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """Poll until the job's state is one of ``states``; returns its last fields."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(2)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {fields}\n{self.logs()}")

    def logs(self, lines: int = 30) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.folder / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def _spawn(self, command: list[str]) -> None:
        log = open(self.folder / f"{command[0]}.out", "wb")
        self._started.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _start_munge(self) -> None:
        if _munge_answers():
            return
        MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
        self._spawn(["runuser", "-u", "munge", "--", "munged", "--foreground"])
        deadline = time.monotonic() + 20
        while not _munge_answers():
            if time.monotonic() > deadline:
                raise RuntimeError("munged did not start (is /etc/munge/munge.key there?)")
            time.sleep(0.5)


def _munge_answers() -> bool:
    try:
        credential = subprocess.run(["munge", "-n"], capture_output=True, timeout=5, check=True).stdout
        subprocess.run(["unmunge"], input=credential, capture_output=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", type=int, default=4, help="CPUs the node declares (default 4)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="run this with SLURM_CONF set, then stop")
    args = parser.parse_args(argv)
    command = [part for part in args.command if part != "--"]
    with OneNodeSlurm(cpus=args.cpus) as slurm:
        print(f"one-node Slurm up: SLURM_CONF={slurm.conf}", file=sys.stderr)
        if not command:
            print("no command given; stopping", file=sys.stderr)
            return 0
        return subprocess.run(command, env=slurm.env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
