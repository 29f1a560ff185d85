"""What every worker sets up once Horovod runs and before it trains: devices, threads, what the job can do."""

from __future__ import annotations

from types import ModuleType

import torch

from hvd_plugins.core.backend import capabilities
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.cpu_threads import apply_cpu_threads


def prepare_worker(config: HorovodConfig, hvd: ModuleType, device: torch.device) -> None:
    """Refuse what this job cannot do, share the host's cores, and put a GPU worker on its GPU."""
    on_gpu = device.type == "cuda"
    capabilities.require_job_supports(config, on_gpu)
    apply_cpu_threads(config.cpu_threads, hvd.local_size())
    if on_gpu:
        index = device.index if device.index is not None else hvd.local_rank()  # a worker that sees one GPU: 0
        capabilities.require_gpu_for_local_rank(index, torch.cuda.device_count(), hvd.local_size())
        torch.cuda.set_device(device)
