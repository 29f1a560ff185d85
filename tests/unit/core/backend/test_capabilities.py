"""What the Horovod build can do: a CPU-only build and a local rank without a GPU are refused clearly."""

from __future__ import annotations

import horovod.torch as hvd
import pytest

from hvd_plugins.core.backend.capabilities import require_gpu_build, require_gpu_for_local_rank


def test_gpu_checks_on_this_cpu_only_build() -> None:
    """Without a GPU the strategy's own checks are called directly; Lightning refuses accelerator='cuda' first."""
    if hvd.cuda_built() or hvd.rocm_built():
        pytest.skip("this Horovod build has GPU operations")
    with pytest.raises(RuntimeError, match="no GPU support"):
        require_gpu_build(hvd)
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU: this node has 2 GPU"):
        require_gpu_for_local_rank(2, gpus_on_node=2, workers_on_node=4)
    require_gpu_for_local_rank(1, gpus_on_node=2, workers_on_node=2)
