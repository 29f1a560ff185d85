"""What the elastic test workers share: the event log, their flags, and leaving or growing on cue
(tests/test_elastic.py); their data, which carries its indices, is models.IndexedData."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import horovod.torch as hvd


class Events:
    """One JSON line per event, appended by every worker of the job to one file."""

    def __init__(self, out: Path) -> None:
        self.path = out / "events.jsonl"

    def write(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "time": time.time(), "pid": os.getpid(), **fields}
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hosts-file", type=Path, required=True)
    parser.add_argument("--hosts-after", default="", help="the discovery file's hosts from --grow-step on")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-ranks", default="", help="several ranks killed at --kill-step, comma-separated")
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument(
        "--fail-rank", type=int, default=-1, help="exits with status 1 at --kill-step; the other hosts leave"
    )
    parser.add_argument("--grow-step", type=int, default=-1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--np-start", type=int, default=0, help="workers the job starts with: kills happen then only")
    return parser


GROW_PAUSE_S = 0.5
"""A growing job's pause per step until the workers of ``--hosts-after`` have joined: they import torch and
Lightning first, and a fast run on a loaded machine could otherwise end before they started."""


def slots_of(hosts: str) -> int:
    """Worker slots of a ``host:slots,host:slots`` list."""
    return sum(int(entry.split(":")[1]) for entry in hosts.split(",") if entry)


DISCOVERY_NOTICED_S = 3.0
"""horovodrun runs the discovery script every second: a failing worker waits this long after dropping hosts, so
that the reset after its failure finds them gone (a reset before that would form a world on them first)."""


def rewrite_hosts(args: argparse.Namespace, keep: Callable[[str], bool]) -> None:
    """Keep the discovery file's lines whose host ``keep`` accepts (workers rewrite it one at a time)."""
    with args.hosts_file.open("r+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        kept = [line for line in file.read().split() if keep(line.split(":")[0])]
        file.seek(0)
        file.truncate()
        file.write("\n".join(kept) + "\n")


def fail_and_drop_other_hosts(args: argparse.Namespace, events: Events, step: int) -> NoReturn:
    """A crash on one host while every other host is preempted: the other hosts leave the discovery file and this
    worker exits with status 1, so Horovod blacklists its host and no usable host is left."""
    (args.out / "changed").write_text("failed")
    host = os.environ["HOROVOD_HOSTNAME"]
    rewrite_hosts(args, lambda name: name == host)
    time.sleep(DISCOVERY_NOTICED_S)  # the others wait for this worker in the step's first collective meanwhile
    events.write("failed", rank=hvd.rank(), step=step, host=host)
    os._exit(1)


def leave_or_grow(args: argparse.Namespace, events: Events, step: int) -> None:
    """At ``--kill-step`` the workers of ``--kill-rank`` (or ``--kill-ranks``) drop their hosts from the discovery
    file and SIGKILL themselves (``--fail-rank``: drops the other hosts and exits with status 1); at
    ``--grow-step`` rank 0 writes ``--hosts-after`` there, and each step pauses until the job grew. Once per job."""
    if 0 <= args.grow_step < step and hvd.size() < slots_of(args.hosts_after):
        time.sleep(GROW_PAUSE_S)
    marker = args.out / "changed"
    killed = {args.kill_rank} | {int(rank) for rank in args.kill_ranks.split(",") if rank}
    if args.kill_step >= 0 and step == args.kill_step and hvd.rank() == args.fail_rank and hvd.size() == args.np_start:
        fail_and_drop_other_hosts(args, events, step)
    if args.kill_step >= 0 and step == args.kill_step and hvd.rank() in killed and hvd.size() == args.np_start:
        marker.write_text("killed")
        host = os.environ["HOROVOD_HOSTNAME"]  # this worker's host leaves the job with it
        rewrite_hosts(args, lambda name: name != host)
        events.write("killed", rank=hvd.rank(), step=step, host=host)
        os.kill(os.getpid(), signal.SIGKILL)
    if marker.exists():
        return
    if args.grow_step >= 0 and step == args.grow_step and hvd.rank() == 0:
        marker.write_text("grown")
        args.hosts_file.write_text(args.hosts_after.replace(",", "\n") + "\n")
        events.write("grown", rank=hvd.rank(), step=step)
