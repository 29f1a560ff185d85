"""Everything that depends on how Horovod 0.28 works inside: start-up, capabilities, private attributes.

``_horovod.py`` imports the module; this file is the only one that knows the rest: which
environment variables ``hvd.init`` reads, which builds can do what, and the private attributes of
Horovod's ``DistributedOptimizer`` that the strategy has to touch. A future Horovod release should
need changes here only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

from hvd_plugins._horovod import horovod_torch
from hvd_plugins.faults import apply_stall_timeout

if TYPE_CHECKING:
    from hvd_plugins.config import HorovodConfig

NATIVE_HIERARCHICAL_ENV = "HOROVOD_HIERARCHICAL_ALLREDUCE"


# ---------------------------------------------------------------------------- start-up
def init_horovod(config: HorovodConfig) -> ModuleType:
    """Start Horovod with what ``config`` needs (idempotent: a script's own ``hvd.init()`` is kept).

    Node-aware syncs need no process sets (``comm.partners``), so Horovod is started plainly and
    never restarted; only Horovod's native hierarchical allreduce is switched on before the start.
    """
    hvd = horovod_torch()
    apply_stall_timeout(config.stall_timeout_seconds, horovod_initialized=hvd.is_initialized())
    if not hvd.is_initialized():
        if config.native_hierarchical:
            os.environ[NATIVE_HIERARCHICAL_ENV] = "1"
        hvd.init()
    return hvd


# ---------------------------------------------------------------------------- capabilities
def require_build_supports(config: HorovodConfig) -> None:
    """Checks that need only the build, so a bad choice fails when the strategy is created."""
    if config.op == "adasum" and not horovod_torch().mpi_built():
        raise ValueError(
            "op='adasum' needs Horovod's MPI controller, but this Horovod build has no MPI. Use op='average' or "
            "'sum', or build Horovod with MPI (HVD_MPI=yes bash ci/install_horovod.sh)."
        )


def require_job_supports(config: HorovodConfig, on_gpu: bool) -> None:
    """Checks that need the running job (controller, GPUs), after ``hvd.init``."""
    hvd = horovod_torch()
    if on_gpu:
        require_gpu_build(hvd)
    if config.op == "adasum" and not hvd.mpi_enabled():
        raise ValueError(
            "op='adasum' needs Horovod's MPI controller, but this job runs without MPI (launched with --gloo?). "
            "Use op='average' or 'sum', or launch with MPI."
        )
    if config.native_hierarchical and not (hvd.mpi_enabled() and hvd.nccl_built() and on_gpu):
        raise ValueError(
            "hierarchical_impl='native' needs the MPI controller, NCCL and GPUs; this job has "
            f"mpi={hvd.mpi_enabled()}, nccl={bool(hvd.nccl_built())}, gpu={on_gpu}. "
            "Use hierarchical_impl='portable', which works on every build."
        )


def require_gpu_build(hvd: ModuleType) -> None:
    """Raise when GPUs are asked for but Horovod was built without CUDA/ROCm operations."""
    if not (hvd.cuda_built() or hvd.rocm_built()):
        raise RuntimeError(
            "Training on GPUs was asked for, but this Horovod build has no GPU support. Rebuild it "
            "with NCCL: HVD_GPU=nccl bash ci/install_horovod.sh"
        )


def require_gpu_for_local_rank(local_rank: int, gpus_on_node: int, workers_on_node: int) -> None:
    """Raise when horovodrun started more workers on a node than it has GPUs."""
    if local_rank >= gpus_on_node:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: this node has {gpus_on_node} GPU(s) "
            f"but horovodrun started {workers_on_node} workers on it"
        )


# ---------------------------------------------------------------------------- waiting
POLL_START_S = 20e-6
POLL_MAX_S = 1e-3
"""A waiting worker sleeps between polls, from 20 us doubling up to Horovod's 1 ms cycle."""


def wait_for(handle: Any) -> Any:
    """``hvd.synchronize(handle)`` without keeping a core busy while the collective is in flight.

    Horovod's own wait spins (``WaitAndClear`` loops on ``std::this_thread::yield``), so on a host
    with more workers than cores the workers that wait take the CPU from those still computing
    and from Horovod's background threads, and every collective waits for the slowest of them.
    Polling with short sleeps hands the core back; it adds at most one poll interval.
    """
    hvd = horovod_torch()
    _sleep_until(lambda: hvd.poll(handle))
    return hvd.synchronize(handle)


def wait_for_pending_allreduces(optimizer: Optimizer) -> None:
    """Let a DistributedOptimizer's allreduces in flight finish (as ``wait_for`` does) before it synchronizes."""
    hvd = horovod_torch()
    handles = [handle for handle, _ in getattr(optimizer, "_handles", {}).values() if handle is not None]
    _sleep_until(lambda: all(hvd.poll(handle) for handle in handles))


def _sleep_until(done: Callable[[], bool]) -> None:
    pause = POLL_START_S
    while not done():
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


# ---------------------------------------------------------------------------- rendezvous server internals
def rendezvous_arrivals(server: Any) -> set[int]:
    """Ranks that have reached ``hvd.init()`` and put their address into a Gloo ``RendezvousServer``.

    Each rank's Gloo context writes the keys ``<rank>`` and ``rank_<rank>`` in the ``global``
    scope of the server's key-value cache; the scope is cleared only once every rank has connected.
    """
    httpd = server._httpd
    with httpd.cache_lock:
        keys = list(httpd.cache.get("global", {}))
    return {int(key.removeprefix("rank_")) for key in keys if key.removeprefix("rank_").isdigit()}


# ---------------------------------------------------------------------------- DistributedOptimizer internals
def set_backward_passes(optimizer: Optimizer, passes: int) -> None:
    """Change how many backward passes a DistributedOptimizer accumulates before it allreduces.

    Safe between steps only: no allreduce is pending, so the per-parameter countdowns can restart.
    """
    if hasattr(optimizer, "backward_passes_per_step"):
        optimizer.backward_passes_per_step = passes
        for parameter in optimizer._allreduce_delay:
            optimizer._allreduce_delay[parameter] = passes


def drop_gradient_hooks(optimizer: Optimizer) -> None:
    """Forget a DistributedOptimizer's gradient hooks, so a later fit in this process starts clean."""
    getattr(optimizer, "_grad_accs", []).clear()


def pin_zero_grad(lightning_optimizers: Iterable[Any]) -> None:
    """Give each LightningOptimizer a ``zero_grad`` that works as it does under DDP.

    Horovod's own ``zero_grad`` calls ``super(self.__class__, self)``, which recurses forever on a
    LightningOptimizer (it subclasses the wrapped class), so each gets a function bound to the
    optimizer it wraps instead.
    """
    for lightning_optimizer in lightning_optimizers:
        lightning_optimizer.zero_grad = _zero_grad_completing_allreduces(lightning_optimizer._optimizer)


def _zero_grad_completing_allreduces(optimizer: Optimizer) -> Callable[..., None]:
    """``zero_grad`` that first completes allreduces a backward started for this optimizer.

    In a GAN step written the DDP way (no ``toggle_optimizer``), the generator's backward also
    produces discriminator gradients, whose hooks start allreduces; Horovod's ``zero_grad`` then
    refuses to run. Every rank ran the same backward, so every rank waits for the same
    allreduces here, and the gradients are then dropped, as DDP drops them.
    """
    if not hasattr(optimizer, "_handles"):  # not a DistributedOptimizer (node-aware syncs wrap nothing)
        return optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        if optimizer._handles:
            optimizer.synchronize()
        super(type(optimizer), optimizer).zero_grad(set_to_none=set_to_none)

    return zero_grad
