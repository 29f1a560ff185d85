"""The suite's fork server (tests/forkserver.py) starts workers as ``python SCRIPT ARGS`` would, only faster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hvd_launch import FORKSERVER, forkserver_env

REPORT = """
import json, os, sys
print(json.dumps({
    "preloaded": "torch" in sys.modules,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "name": __name__,
    "path0": sys.path[0],
    "variable": os.environ.get("FORKSERVER_CHECK"),
    "server_variable": os.environ.get("HVD_TEST_FORKSERVER"),
}))
sys.stderr.write("to stderr\\n")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def server_env() -> dict[str, str]:
    env = forkserver_env()
    if not env:
        pytest.skip("the fork server did not start here; workers start the plain way")
    return {**os.environ, **env}


def start(script: Path, *args: str, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(FORKSERVER), "run", str(script), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_forked_worker_has_its_arguments_environment_directory_streams_and_exit_code(
    server_env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "scripts" / "report.py"
    script.parent.mkdir()
    script.write_text(REPORT)
    process = start(script, "3", "second", env={**server_env, "FORKSERVER_CHECK": "yes"}, cwd=tmp_path)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 3, err
    report = json.loads(out)
    assert report == {
        "preloaded": True,
        "argv": [str(script), "3", "second"],
        "cwd": str(tmp_path),
        "name": "__main__",
        "path0": str(script.parent),
        "variable": "yes",
        "server_variable": None,
    }
    assert err == "to stderr\n"


def test_a_worker_whose_start_up_variables_differ_starts_the_plain_way(
    server_env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    threads = str(int(server_env.get("OMP_NUM_THREADS", "1")) + 1)
    process = start(script, "0", env={**server_env, "OMP_NUM_THREADS": threads}, cwd=tmp_path)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert json.loads(out)["preloaded"] is False


def test_a_worker_killed_by_a_signal_ends_its_command_with_that_signal(
    server_env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "die.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    process = start(script, env=server_env, cwd=tmp_path)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL

    script.write_text("raise KeyboardInterrupt\n")  # uncaught, Python ends by dying of SIGINT
    process = start(script, env=server_env, cwd=tmp_path)
    _, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGINT and "KeyboardInterrupt" in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_signal_to_the_command_reaches_the_worker(server_env: dict[str, str], tmp_path: Path, signum: int) -> None:
    """SIGTERM is passed on; SIGKILL cannot be, and the worker and what it started die with their command."""
    pid_file = tmp_path / "pid"
    script = tmp_path / "sleep.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
        "                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        f"open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(120)\n"
    )
    process = start(script, env=server_env, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and process.poll() is None, "the worker did not start"
        time.sleep(0.05)
    worker, grandchild = (int(pid) for pid in pid_file.read_text().split())
    process.send_signal(signum)
    process.communicate(timeout=60)
    assert process.returncode == -signum
    deadline = time.monotonic() + 30
    while _alive(worker) or (signum == signal.SIGKILL and _alive(grandchild)):
        assert time.monotonic() < deadline, f"worker {worker} or what it started outlived its command"
        time.sleep(0.05)
    if _alive(grandchild):  # after SIGTERM the worker died as a plain one would: its child lives on
        os.kill(grandchild, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, waiting for the server to reap it


def test_a_worker_ends_as_python_does_threads_joined_exit_handlers_run_streams_flushed(
    server_env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "ending.py"
    script.write_text(
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished'))).start()\n"
        "sys.stdout.write('buffered, no newline')\n"
        "sys.exit('a message')\n"
    )
    process = start(script, env=server_env, cwd=tmp_path)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert out == "buffered, no newlinethread finished\nexit handler ran\n"
    assert err == "a message\n"


def test_neighbouring_ranks_hash_strings_differently_as_separate_processes_do(
    server_env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "hashes.py"
    script.write_text("import sys\nprint(hash('hvd_plugins'), 'torch' in sys.modules)\n")

    def hash_on_rank(rank: int, **extra: str) -> tuple[str, str]:
        process = start(script, env={**server_env, "HOROVOD_RANK": str(rank), **extra}, cwd=tmp_path)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        value, preloaded = out.split()
        return value, preloaded

    assert hash_on_rank(0)[1] == hash_on_rank(1)[1] == "True"
    assert hash_on_rank(0)[0] != hash_on_rank(1)[0]
    assert hash_on_rank(0)[0] == hash_on_rank(2)[0]  # the same server
    fixed = subprocess.run(
        [sys.executable, "-c", "print(hash('hvd_plugins'))"],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert hash_on_rank(1, PYTHONHASHSEED="0") == (fixed, "False")  # a seed of its own: the plain way
