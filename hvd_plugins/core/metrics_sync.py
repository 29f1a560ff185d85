"""Make torchmetrics metrics reduce over Horovod workers.

torchmetrics syncs metric states through ``torch.distributed``, which a Horovod job does not
initialise, so by default every rank would report its local value. The strategy points each
metric of the LightningModule at these Horovod-backed functions instead.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.comm.naming import COLLECTIVE_NAMES
from hvd_plugins.core.comm.wire import GATHER, for_wire, from_wire


def horovod_available() -> bool:
    """torchmetrics' ``distributed_available_fn``: sync only when there is someone to sync with."""
    hvd = horovod_torch()
    return hvd.is_initialized() and hvd.size() > 1


def gather_all_tensors(result: Tensor, group: object = None) -> list[Tensor]:
    """torchmetrics' ``dist_sync_fn``: every rank's tensor, in rank order, shapes may differ."""
    # Evaluation runs under inference mode, but Horovod allocates the gathered output on its own
    # thread, where inference tensors cannot be resized: gather normal tensors.
    with torch.inference_mode(False):
        return _gather_all_tensors(result.clone(), group)


def _gather_all_tensors(result: Tensor, group: object) -> list[Tensor]:
    if group is not None:
        raise ValueError(f"gather_all_tensors got group={group!r}; Horovod metric sync covers all workers only")
    hvd = horovod_torch()
    original_dtype = result.dtype
    tensor = for_wire(result.detach().contiguous(), GATHER)
    scalar = tensor.ndim == 0
    if scalar:
        tensor = tensor.reshape(1)
    shapes = hvd.allgather(torch.tensor([tensor.shape], dtype=torch.int64), name=COLLECTIVE_NAMES.next("metric_shape"))
    largest = shapes.max(dim=0).values.tolist()
    padding = []
    for size, target in zip(reversed(tensor.shape), reversed(largest), strict=True):
        padding += [0, target - size]
    padded = torch.nn.functional.pad(tensor, padding) if any(padding) else tensor
    gathered = hvd.allgather(padded.unsqueeze(0), name=COLLECTIVE_NAMES.next("metric"))
    pieces = []
    for row, shape in zip(gathered, shapes.tolist(), strict=True):
        piece = row[tuple(slice(0, size) for size in shape)]
        piece = piece.reshape(()) if scalar else piece
        pieces.append(from_wire(piece, original_dtype, GATHER))
    return pieces


def attach_horovod_metric_sync(model: Module) -> int:
    """Point every torchmetrics Metric inside ``model`` at Horovod; returns how many were attached.

    Metrics whose user already chose a ``dist_sync_fn`` are left alone.
    """
    try:
        from torchmetrics import Metric
    except ImportError:
        return 0
    attached = 0
    for module in model.modules():
        if isinstance(module, Metric) and module.dist_sync_fn is None:
            module.dist_sync_fn = gather_all_tensors
            module.distributed_available_fn = horovod_available
            attached += 1
    return attached
