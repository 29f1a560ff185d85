"""GPU paths (NCCL build, cuda:<local_rank>, fp16 AMP, bfloat16 collectives, bf16-true). Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _common import report_of
from gpu_checks import amp_fp16_compressed, bf16_collectives, bf16_mixed_bf16_wire, bf16_true, fp32
from hvd_launch import run_job


def _nccl_built() -> bool:
    import horovod.torch as hvd

    return bool(hvd.nccl_built())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_training_on_gpus_with_nccl(tmp_path: Path) -> None:
    if not _nccl_built():
        pytest.skip("Horovod was built without NCCL (hvd-build-horovod --gpu nccl)")
    workers = min(2, torch.cuda.device_count())
    job = run_job("gpu_checks.py", np=workers, out_dir=tmp_path, timeout=600).check()
    for report in job.results.values():
        assert all(report_of(report, bf16_collectives).values()), report_of(report, bf16_collectives)
        for check in (fp32, amp_fp16_compressed, bf16_true, bf16_mixed_bf16_wire):
            result = report_of(report, check)
            assert result["device"] == f"cuda:{result['local_rank']}"
            assert len(set(result["digests"])) == 1  # identical weights on every GPU
            assert result["loss"] < 1.0
            if workers > 1:
                assert result["bytes"] > 0
