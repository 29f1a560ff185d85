"""Start test workers from a process that has already imported torch, Lightning and Horovod.

On this suite's small hosts a worker spends about 5 s of CPU importing those before it does anything
else, and the suite starts a few hundred workers. ``serve`` imports them once and forks a child for
every worker; ``run`` is the tiny command horovodrun starts in the worker's place::

    python tests/forkserver.py serve SOCKET      # two per test session (tests/hvd_launch.py starts them)
    python tests/forkserver.py run SCRIPT ARGS   # what horovodrun runs for each rank

``run`` hands the server its standard streams, environment, working directory and arguments; the
forked child takes them all and runs SCRIPT as ``__main__``, as ``python SCRIPT ARGS`` would. ``run``
stays the process horovodrun knows: it passes on the signals it gets, exits with the child's exit
code (or dies of the child's signal). When ``run`` is killed, the server kills the child's
process group (the child and what it started), and the child kills itself should the server be
gone. Without a server (no ``HVD_TEST_FORKSERVER``, or none listening) ``run`` becomes
``python SCRIPT ARGS``.

A worker whose environment differs from the server's in what those imports read at start-up
(threads, devices, Python's own variables, Lightning's rank variables) also starts the plain way.
Only the standard library is imported until ``serve`` preloads.
"""

from __future__ import annotations

import array
import atexit
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import warnings
from typing import Any

SOCKET_VARIABLE = "HVD_TEST_FORKSERVER"
PRELOADED = ("torch", "lightning", "pytorch_lightning", "horovod.torch")
"""Third-party imports only: hvd_plugins (0.1 s once these are loaded) is imported by each worker itself,
so what it does at import with the worker's environment (its rank, Slurm's signals) happens for real."""
IMPORT_TIME_VARIABLES = (
    "PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH_", "CUDA_", "LD_", "SLURM_", "PL_",
)  # fmt: skip
IMPORT_TIME_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK")
"""Variables the preloaded imports (or Python itself) read at start-up: a worker whose values differ
from the server's starts the plain way."""
PER_WORKER_PYTHON_VARIABLES = ("PYTHONWARNINGS", "PYTHONUNBUFFERED")
"""The two start-up variables a forked worker takes on itself."""
HASH_SEED = "PYTHONHASHSEED"
"""Each server runs with a seed of its own and ranks go to servers in turn, so neighbouring ranks hash
strings differently (iterate sets in other orders), as separate processes do. A worker that sets
the variable itself starts the plain way unless its server has the same seed."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
STREAMS = (0, 1, 2)
_INT = struct.Struct("!i")
_FILTERS_FROM_IMPORTS: tuple[list[Any], list[Any]] = ([], [])
"""The warning filters the preloaded imports added, and Python's default filters."""


# ---------------------------------------------------------------------------------------- wire
def _send_request(connection: socket.socket, request: dict[str, Any]) -> None:
    payload = json.dumps(request).encode()
    fds = array.array("i", STREAMS)
    connection.sendmsg([_INT.pack(len(payload))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
    connection.sendall(payload)


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        data += chunk
    return data


def _receive_request(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header, ancillary, _, _ = connection.recvmsg(_INT.size, socket.CMSG_SPACE(len(STREAMS) * _INT.size))
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    try:
        header += _receive_exactly(connection, _INT.size - len(header))
        (size,) = _INT.unpack(header)
        request = json.loads(_receive_exactly(connection, size))
        if len(fds) != len(STREAMS):
            raise ValueError(f"expected {len(STREAMS)} streams, got {len(fds)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, list(fds)


# -------------------------------------------------------------------------------------- server
def serve(path: str) -> tuple[socket.socket, dict[str, Any], list[int]] | None:
    """Preload, then fork a child per request; return in the child (with its request), never in the server."""
    import importlib
    import importlib.util

    global _FILTERS_FROM_IMPORTS
    defaults = list(warnings.filters)  # the server starts without -W or PYTHONWARNINGS: Python's defaults
    for name in PRELOADED:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    _FILTERS_FROM_IMPORTS = (list(warnings.filters[: len(warnings.filters) - len(defaults)]), defaults)
    gc.freeze()  # the children's collections then leave the preloaded objects (and their shared pages) alone
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    orphans: set[int] = set()  # children whose run is gone: killed, waiting to be reaped
    while True:
        watched = [connection for pid, connection in children.items() if pid not in orphans]
        readable, _, _ = select.select([listener, sys.stdin, *watched], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return None  # the test session ended (or died): so does the server
        for pid, connection in list(children.items()):
            if connection in readable and pid not in orphans and not _receive_or_eof(connection):
                _kill_group(pid)  # its run was killed: so is the worker, with whatever it started
                orphans.add(pid)
        if listener in readable:
            connection, _ = listener.accept()
            try:
                request, fds = _receive_request(connection)
            except (OSError, ValueError):
                connection.close()
                continue
            if not _forkable(request["env"]):
                for fd in fds:
                    os.close(fd)
                _send_quietly(connection, 0)  # run starts the worker the plain way
                connection.close()
                continue
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)  # its own group, so that killing it takes what it started too
                listener.close()
                for other in children.values():
                    other.close()
                return connection, request, fds
            for fd in fds:
                os.close(fd)
            children[pid] = connection
            if not _send_quietly(connection, pid):
                _kill_group(pid)
                orphans.add(pid)
        _reap(children, orphans)


def _import_time_values(env: Any) -> dict[str, str]:
    return {
        name: value
        for name, value in env.items()
        if (name.startswith(IMPORT_TIME_VARIABLES) or name in IMPORT_TIME_NAMES)
        and name not in (*PER_WORKER_PYTHON_VARIABLES, HASH_SEED)
    }


def _forkable(env: dict[str, str]) -> bool:
    """Whether a worker with this environment would start as this server did."""
    if HASH_SEED in env and env[HASH_SEED] != os.environ.get(HASH_SEED):
        return False
    return _import_time_values(env) == _import_time_values(os.environ)


def _receive_or_eof(connection: socket.socket) -> bool:
    """False once ``run``'s end has closed (``run`` sends nothing after its request)."""
    try:
        return bool(connection.recv(1))
    except OSError:
        return False


def _send_quietly(connection: socket.socket, value: int) -> bool:
    try:
        connection.sendall(_INT.pack(value))
        return True
    except OSError:
        return False  # its run was killed meanwhile


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(children: dict[int, socket.socket], orphans: set[int]) -> None:
    """Tell each finished child's ``run`` how it ended: its exit code, or minus the signal that killed it."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        orphans.discard(pid)
        connection = children.pop(pid, None)
        if connection is not None:
            _send_quietly(connection, os.waitstatus_to_exitcode(status))
            connection.close()


def become_worker(connection: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: take the worker's streams, environment and arguments, then run its script."""
    import runpy

    for target, fd in zip(STREAMS, fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for signum in (*FORWARDED_SIGNALS, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh python has it
    _take_warning_options(os.environ.get("PYTHONWARNINGS", ""))
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]

    def die_with_run() -> None:
        connection.recv(1)  # returns when run's end of the connection closes: run was killed
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_run, name="forkserver-watch", daemon=True).start()
    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT  # Python dies of SIGINT after an uncaught KeyboardInterrupt
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _exit_code(code: object) -> int:
    """What ``sys.exit(code)`` makes the process's exit code."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:  # code: an exit code, or minus a signal to die of
    """End as Python's own exit does (threads joined, atexit run, streams flushed) without tearing
    down every module: in a forked child that teardown touches, and so copies, the server's whole
    heap, which took about a second per worker."""
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as multiprocessing does
    atexit._run_exitfuncs()  # type: ignore[attr-defined]
    gc.collect()  # objects of the worker's own that need finalizing (the preloaded ones are frozen)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        _die_of(-code)
    os._exit(code)


def _die_of(signum: int) -> None:
    """End this process by ``signum``, as the process it stands for ended (SIGKILL has no handler to reset)."""
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _take_warning_options(options: str) -> None:
    """Warning filters as a fresh ``python`` with this PYTHONWARNINGS would have them after the imports.

    Python installs the options' filters first and the imports put theirs in front; assigning the
    list also forgets which warnings were already shown.
    """
    from_imports, defaults = _FILTERS_FROM_IMPORTS
    sys.warnoptions[:] = [option for option in options.split(",") if option]
    warnings.filters[:] = defaults
    warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]
    warnings.filters[:0] = from_imports
    warnings._filters_mutated()  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------- run
def run(argv: list[str]) -> None:
    """Ask the server for a forked worker running ``argv``; wait for it and end as it ended."""
    servers = [path for path in os.environ.get(SOCKET_VARIABLE, "").split(os.pathsep) if path]
    rank = os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or str(os.getpid())
    path = servers[int(rank) % len(servers)] if servers and rank.isdigit() else None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not path:
            raise OSError("no server")
        connection.connect(path)
        env = {name: value for name, value in os.environ.items() if name != SOCKET_VARIABLE}
        _send_request(connection, {"argv": argv, "env": env, "cwd": os.getcwd()})
        (pid,) = _INT.unpack(_receive_exactly(connection, _INT.size))
        if pid == 0:
            raise OSError("the server asks for a plain start")
    except OSError:
        connection.close()
        os.execv(sys.executable, [sys.executable, *argv])  # no server: the plain way
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, lambda received, _frame: os.kill(pid, received))
    try:
        (code,) = _INT.unpack(_receive_exactly(connection, _INT.size))
    except ConnectionError:
        sys.exit(f"forkserver: the server went away while worker {pid} ran")
    if code < 0:
        _die_of(-code)
    sys.exit(code)


def main() -> None:
    command, arguments = sys.argv[1], sys.argv[2:]
    if command == "run":
        run(arguments)
    elif command == "serve":
        child = serve(arguments[0])
        if child is not None:
            become_worker(*child)
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET | run SCRIPT [ARGS...]")


if __name__ == "__main__":
    main()
