"""Ctrl-C reaches a rank that waits in a collective its peer never joins (the build's sleeping wait).

Rank 0 never joins ``hvd.allreduce``; rank 1 gets SIGINT after a second of waiting and reports
whether the wait raised KeyboardInterrupt, and after how long. Both leave with ``os._exit``: the
collective is still pending, and Horovod's shutdown would wait for it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import horovod.torch as hvd
import torch
from _common import parse_out, write_result

OUT, _ = parse_out()
SIGNAL_AFTER_SECONDS = 1.0

hvd.init()
if hvd.rank() == 0:
    time.sleep(SIGNAL_AFTER_SECONDS + 3)
    os._exit(0)
threading.Timer(SIGNAL_AFTER_SECONDS, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
started = time.monotonic()
try:
    hvd.allreduce(torch.ones(2), name="never_joined")
    outcome = "completed"
except KeyboardInterrupt:
    outcome = "interrupted"
write_result(OUT, hvd.rank(), {"outcome": outcome, "seconds": time.monotonic() - started})
os._exit(0)
