"""Run a command that the kernel kills when the process that started it dies.

    python die_with_parent.py PARENT_PID COMMAND [ARGS...]

Workers started by ``runner.LocalJob`` go through this file, so that a rank 0 that is killed
(or crashes) leaves no worker behind, waiting in a collective forever. The parent-death signal is
set here and survives ``exec``; it needs Linux, elsewhere the command just runs. Only the
standard library is imported: this runs before every worker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def main() -> None:
    parent, command = int(sys.argv[1]), sys.argv[2:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the signal was armed
            sys.exit(f"the process that started this worker ({parent}) is gone")
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
