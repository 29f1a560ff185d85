"""A two-node cluster on one machine: one network namespace per node, a shaped link between them.

Each node is a namespace with a veth ``eth0`` plugged into a bridge in the root namespace (where
Horovod's rendezvous server listens). Each node's ``eth0`` egress is shaped with ``tbf`` (netem is
not available in every kernel), so traffic between nodes is slow while workers inside a node talk
over the namespace's own unshaped loopback. Everything created here is removed by ``teardown``,
which is idempotent; ``NamespaceCluster`` also registers it with ``atexit`` and for SIGINT/SIGTERM.

MPI reaches the nodes as it reaches hosts of a real cluster, through a remote-shell agent:
``mpirun_args()`` names an agent that runs OpenMPI's daemon inside the node's namespace, under the
node's host name, so OpenMPI sees one host per node (``local_size`` is the node's workers). Gloo
jobs start without ssh: ``run_on_cluster`` hands Horovod's launcher a command that enters the node.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

SHAPER_BURST_BYTES = 256 * 1024
"""tbf's bucket: this many bytes pass at the line rate before the shaped rate applies (tc's ``256kb``)."""
UNSHAPED = "unshaped"
SKIP_EXIT_CODE = 77
"""Exit code of a script that needs the cluster where it cannot be built (the test suite then skips)."""


def shaping_for(link_mbit: float | None) -> str:
    """The ``tc`` qdisc arguments that cap a node's egress at ``link_mbit``; ``None``: unshaped ("")."""
    if link_mbit is None:
        return ""
    if link_mbit <= 0:
        raise ValueError(f"link rate {link_mbit!r} Mbit/s must be > 0 (or None for an unshaped link)")
    return f"tbf rate {link_mbit:g}mbit burst {SHAPER_BURST_BYTES // 1024}kb latency 50ms"


SHAPING = shaping_for(200.0)
"""The default shaping of a cluster's links: 200 Mbit/s."""


def parse_link(text: str) -> float | None:
    """A link rate as given on a command line: ``"50"`` -> 50.0 Mbit/s; ``"unshaped"`` -> None."""
    if text.strip().lower() == UNSHAPED:
        return None
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"--link-mbit {text!r} must be a rate in Mbit/s (e.g. 50) or {UNSHAPED!r}") from None
    if not rate > 0:
        raise ValueError(f"--link-mbit {text!r} must be > 0 Mbit/s or {UNSHAPED!r}")
    return rate


def link_label(link_mbit: float | None) -> str:
    """How tables and records name a link: its rate in Mbit/s, or ``unshaped``."""
    return UNSHAPED if link_mbit is None else f"{link_mbit:g}"


SUBNET_CANDIDATES = [ipaddress.IPv4Network(f"10.213.{third}.0/24") for third in range(100, 200)]


class ClusterUnavailable(RuntimeError):
    """Namespaces, veths, bridges or tc cannot be used here (not root, no ip/tc, a locked-down kernel)."""


def _run(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, command, result.stdout, result.stderr)
    return result.stdout


def _quiet(*command: str) -> None:
    subprocess.run(command, capture_output=True, text=True, timeout=30)


def pick_free_subnet() -> ipaddress.IPv4Network:
    """The first candidate /24 that overlaps no address or route on this machine."""
    used = _run("ip", "-4", "-o", "addr", "show") + _run("ip", "-4", "route", "show", "table", "all")
    taken = set()
    for token in used.split():
        try:
            taken.add(ipaddress.ip_network(token, strict=False))
        except ValueError:
            continue
    for candidate in SUBNET_CANDIDATES:
        if not any(candidate.overlaps(net) for net in taken if net.prefixlen > 0):
            return candidate
    raise ClusterUnavailable("no free private test subnet among 10.213.100-199.0/24")


_clusters_made = itertools.count()


def process_tag() -> str:
    """What the names of every cluster this process makes begin with."""
    return f"hb{os.getpid() % 100000}"


def _next_tag() -> str:
    """A prefix no other cluster of this machine uses: the process, and which of its clusters (two may coexist)."""
    return f"{process_tag()}{'abcdefghijklmnopqrstuvwxyz'[next(_clusters_made) % 26]}"


@dataclass
class NamespaceCluster:
    """``nodes`` namespaces joined by a bridge; node ``i`` is host name ``node{i}``."""

    nodes: int = 2
    shaping: str = SHAPING
    tag: str = field(default_factory=lambda: _next_tag())
    subnet: ipaddress.IPv4Network | None = None
    created: bool = False

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def namespace(self, node: int) -> str:
        return f"{self.tag}-node{node}"

    def host_name(self, node: int) -> str:
        return f"node{node}"

    def _veth(self, node: int) -> str:
        return f"{self.tag}v{node}"

    def _hosts_file(self, node: int) -> Path:
        return Path("/etc/netns") / self.namespace(node) / "hosts"

    @property
    def bridge_ip(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def node_ip(self, node: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 10 + node)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> NamespaceCluster:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def create(self) -> None:
        if os.geteuid() != 0:
            raise ClusterUnavailable("needs root (network namespaces, veth, bridge and tc)")
        for tool in ("ip", "tc", "unshare"):
            if shutil.which(tool) is None:
                raise ClusterUnavailable(f"`{tool}` is not installed")
        self.subnet = self.subnet or pick_free_subnet()
        atexit.register(self.teardown)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._teardown_and_exit)
        self.created = True
        try:
            self._build()
        except (subprocess.CalledProcessError, OSError) as error:
            self.teardown()
            detail = getattr(error, "stderr", "") or str(error)
            raise ClusterUnavailable(f"could not build the namespaces: {detail.strip()}") from error

    def _build(self) -> None:
        prefix = self.subnet.prefixlen if self.subnet else 24
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.bridge_ip}/{prefix}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.node_ip(n)} {self.host_name(n)}\n" for n in range(self.nodes))
        for node in range(self.nodes):
            ns, veth, peer = self.namespace(node), self._veth(node), f"{self._veth(node)}p"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", peer, "netns", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", peer, "name", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.node_ip(node)}/{prefix}", "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            if self.shaping:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *self.shaping.split())
            # The node's host name must resolve to its own address (Gloo resolves it), as on a real cluster.
            self._hosts_file(node).parent.mkdir(parents=True, exist_ok=True)
            self._hosts_file(node).write_text(hosts)

    def reshape(self, shaping: str) -> None:
        """Change every node's egress shaping in place (``""``: unshaped), without rebuilding the cluster."""
        for node in range(self.nodes):
            in_node = ("ip", "netns", "exec", self.namespace(node), "tc", "qdisc")
            _quiet(*in_node, "del", "dev", "eth0", "root")  # fails harmlessly when already unshaped
            if shaping:
                _run(*in_node, "add", "dev", "eth0", "root", *shaping.split())
        self.shaping = shaping

    def check_reachable(self, python: str) -> None:
        """Each node reaches the bridge and the other nodes over TCP; raise ClusterUnavailable otherwise.

        A refused connection to the discard port proves the route works (no ping needed).
        """
        probe = (
            "import socket, sys\n"
            "try:\n socket.create_connection((sys.argv[1], 9), timeout=3)\n"
            "except ConnectionRefusedError:\n pass\n"
        )
        for node in range(self.nodes):
            for target in [self.bridge_ip] + [self.node_ip(n) for n in range(self.nodes) if n != node]:
                try:
                    _run("ip", "netns", "exec", self.namespace(node), python, "-c", probe, target)
                except subprocess.CalledProcessError as error:
                    raise ClusterUnavailable(f"node{node} cannot reach {target}: {error.stderr[-300:]}") from error

    def teardown(self) -> None:
        """Remove namespaces (and with them their veths), the bridge and the hosts files; never raises."""
        if not self.created:
            return
        self.created = False
        for node in range(self.nodes):
            _quiet("ip", "netns", "del", self.namespace(node))
            _quiet("ip", "link", "del", self._veth(node))
            shutil.rmtree(self._hosts_file(node).parent, ignore_errors=True)
        _quiet("ip", "link", "del", self.bridge)

    def _teardown_and_exit(self, signum: int, frame: FrameType | None) -> None:
        self.teardown()
        raise SystemExit(128 + signum)

    def rsh_agent(self, folder: Path) -> Path:
        """A script for ``--mca plm_rsh_agent``: ``agent <node address> <command...>`` runs it in that node."""
        cases = "".join(
            f"  {self.node_ip(n)}|{self.host_name(n)}) ns={self.namespace(n)}; name={self.host_name(n)} ;;\n"
            for n in range(self.nodes)
        )
        agent = folder / f"{self.tag}-rsh-agent.sh"
        agent.write_text(
            "#!/bin/bash\n# OpenMPI's remote shell for the namespace cluster: enter the node, then run the command.\n"
            'host="$1"; shift\n'
            f'case "$host" in\n{cases}  *) echo "no node named $host" >&2; exit 255 ;;\nesac\n'
            'exec ip netns exec "$ns" unshare --uts bash -c "hostname $name; $*"\n'
        )
        agent.chmod(0o755)
        return agent

    def mpirun_args(self, folder: Path) -> list[str]:
        """``mpirun`` options that start each node's workers inside it and keep MPI's traffic on the bridge."""
        assert self.subnet is not None
        return [
            "--mca", "plm_rsh_agent", str(self.rsh_agent(folder)),
            "--mca", "oob_tcp_if_include", str(self.subnet),
            "--mca", "btl_tcp_if_include", str(self.subnet),
            "--mca", "btl", "self,vader,tcp",
        ]  # fmt: skip

    def mpi_hosts(self, workers_per_node: int) -> str:
        """``--host`` for mpirun: every node by address, with its slots."""
        return ",".join(f"{self.node_ip(n)}:{workers_per_node}" for n in range(self.nodes))

    def worker_command(self, node: int, command: str) -> list[str]:
        """Run ``command`` inside node ``node``: its namespace, and its own host name (new UTS namespace)."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace(node),
            "unshare",
            "--uts",
            "bash",
            "-c",
            f"hostname {self.host_name(node)}; {command}",
        ]


def run_on_cluster(
    cluster: NamespaceCluster,
    command: Sequence[str],
    workers_per_node: int,
    logs: Path,
    limit_s: float,
    cwd: Path | None = None,
) -> None:
    """Run ``command`` as ``workers_per_node`` Horovod workers in every node, each rank's output in ``logs``.

    Horovod's Gloo launcher (``launch_gloo``) starts each worker through a command that enters its
    node, so no ssh is needed. Every worker is killed once ``limit_s`` has passed or another rank
    failed (a rank that failed leaves the others waiting in a collective); raises RuntimeError with
    the logs' tails if any rank failed, KeyboardInterrupt on Ctrl-C or SIGTERM.
    """
    from horovod.runner.common.util.settings import Settings
    from horovod.runner.gloo_run import launch_gloo

    venv_bin = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "VIRTUAL_ENV": os.environ.get("VIRTUAL_ENV", str(Path(venv_bin).parent)),
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "120",  # process-set rendezvous waits for the slowest worker
    }
    hosts = ",".join(f"{cluster.host_name(n)}:{workers_per_node}" for n in range(cluster.nodes))
    settings = Settings(hosts=hosts, num_proc=workers_per_node * cluster.nodes, verbose=0)
    deadline = time.monotonic() + limit_s
    logs.mkdir(parents=True, exist_ok=True)
    enter = f"cd {shlex.quote(str(cwd))} && " if cwd is not None else ""
    stopped_by: set[str] = set()  # "signal" (Ctrl-C, SIGTERM), "deadline" or "failure" (another rank failed)

    def exec_command(command: str, slot_info: Any, events: list[threading.Event]) -> tuple[int, float]:
        node = int(slot_info.hostname.removeprefix("node"))
        wrapped = cluster.worker_command(node, enter + command)
        with open(logs / f"rank{slot_info.rank}.log", "w") as log:
            process = subprocess.Popen(wrapped, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            while process.poll() is None:
                interrupted = any(event.is_set() for event in events)  # launch_gloo sets them on a signal
                if interrupted or time.monotonic() > deadline or "failure" in stopped_by:
                    # A rank that failed leaves the others waiting in a collective: stop them now.
                    stopped_by.add("signal" if interrupted else "failure" if "failure" in stopped_by else "deadline")
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    return 124, time.time()
                time.sleep(0.2)
        if process.returncode != 0:
            stopped_by.add("failure")
        return process.returncode, time.time()

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        launch_gloo(list(command), exec_command, settings, nics={"eth0"}, env=env, server_ip=cluster.bridge_ip)
    except RuntimeError as error:
        if "signal" in stopped_by:  # stop the whole run; the caller's context removes the namespaces
            raise KeyboardInterrupt from None
        limit = f"killed after {limit_s:.0f} s\n" if "deadline" in stopped_by else ""
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.log")))
        raise RuntimeError(f"{limit}{error}\n{tails}") from None
    finally:
        for signum, handler in previous.items():  # launch_gloo replaces them with its own
            signal.signal(signum, handler)
    if "signal" in stopped_by:
        raise KeyboardInterrupt
