"""What a Horovod build and a running job can do, checked before the first collective."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from hvd_plugins.core.backend.bfloat16 import require_bfloat16
from hvd_plugins.core.backend.module import horovod_torch

if TYPE_CHECKING:
    from hvd_plugins.core.config import HorovodConfig


def require_build_supports(config: HorovodConfig) -> None:
    """Checks that need only the build, so a missing Horovod or a bad choice fails when the strategy is created."""
    hvd = horovod_torch()  # raises HorovodUnavailable naming the build command
    if config.compression == "bf16":
        require_bfloat16("compression='bf16'", hvd)
    if config.daso is not None and config.daso.downcast == "bf16":
        require_bfloat16("DasoConfig(downcast='bf16')", hvd)
    if config.op == "adasum" and not hvd.mpi_built():
        raise ValueError(
            "op='adasum' needs Horovod's MPI controller, but this Horovod build has no MPI. Use op='average' or "
            "'sum', or build Horovod with MPI (hvd-build-horovod --mpi yes)."
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
            "with NCCL: hvd-build-horovod --gpu nccl"
        )


def require_gpu_for_local_rank(local_rank: int, gpus_on_node: int, workers_on_node: int) -> None:
    """Raise when horovodrun started more workers on a node than it has GPUs."""
    if local_rank >= gpus_on_node:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: this node has {gpus_on_node} GPU(s) "
            f"but horovodrun started {workers_on_node} workers on it"
        )
