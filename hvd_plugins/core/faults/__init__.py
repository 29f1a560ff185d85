"""When a worker fails, stalls or produces garbage: bounded, identical on every rank, and said clearly.

Horovod's launcher ends the whole job when a worker exits non-zero. What it does not bound is a
worker that stays alive but never joins a collective (``watchdog``); gradients are checked with
one decision shared by all ranks (``finite``), configurations compared before the first
collective (``fingerprints``), and failures reported per rank (``report``).
"""

from hvd_plugins.core.faults.finite import NonFiniteGradientError

__all__ = ["NonFiniteGradientError"]
