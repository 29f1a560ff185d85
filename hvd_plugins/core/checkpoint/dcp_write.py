"""Writing a checkpoint in torch's distributed checkpointing format (DCP), every worker its own shards.

DCP's ``save`` is a planner and a storage writer joined by three small collectives of plan objects
(``state_dict_saver``): each worker plans what it holds, a coordinator merges the plans (a tensor every worker
holds whole is written by one of them) and makes the metadata, each worker writes its files, and the coordinator
writes the metadata once every write is done. Here Horovod's ``allgather_object`` and ``broadcast_object`` carry
the plans, so no process group of torch's is needed beside Horovod.

Whatever the state holds as ``FlatPieces`` (a sharded mode's part of a tensor) is written as its boxes; plain
tensors, as DCP writes them; everything else pickled. The state that is not tensors goes beside the shards in
``meta.pt``, as Lightning's sharded checkpoints keep it, so ``dcp_read`` and Lightning's own loaders read it.

The directory is written under a temporary name and renamed into place once complete: a save that fails midway
leaves the last good checkpoint where it was. A failure on one worker is sent to every other in the next
collective, so no worker waits on it.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.checkpoint.boxes import FlatPieces
from hvd_plugins.core.checkpoint.dcp_read import LIGHTNING_META_FILE
from hvd_plugins.core.comm.shards import LocalShard

T = TypeVar("T")


class PiecesPlanner(DefaultSavePlanner):
    """DCP's default planner, which also finds the boxes of a ``FlatPieces`` by their offsets."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, FlatPieces):
            assert index.offset is not None
            return found.box_at(index.offset)
        return super().lookup_object(index)


class SaveFailed(RuntimeError):
    """A worker failed while the checkpoint was written: named on every worker."""


def save_dcp(
    path: str | Path, state: dict[str, Any], meta: dict[str, Any], rank: int, size: int, background: bool = False
) -> PendingSave | None:
    """``state`` (tensors, ``FlatPieces`` and nested dicts of them) written by every worker into the DCP directory
    ``path``, and ``meta`` beside it in ``meta.pt`` by rank 0 (a collective: every worker calls it, with its own
    pieces). On return ``path`` holds the complete checkpoint on every worker.

    With ``background``, each worker first copies what it writes into host memory of its own (``staged``); the
    plans are made, and the files written and put in place by a thread, whose ``PendingSave`` is returned: the
    caller waits on it before its next save, and the process does not exit before it ends."""
    if background:
        state, meta = staged(state), staged(meta)
    target = Path(path)
    token = _from_root(uuid.uuid4().hex if rank == 0 else "", size, "token")
    writing = target.parent / f".{target.name}.writing-{token}"
    writer = FileSystemWriter(writing, single_file_per_rank=True, sync_files=True)
    planner = PiecesPlanner()

    def plan() -> Any:
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    local_plans = _everyone(plan, size, "plan")
    global_plans: Any = []
    metadata: Any = None

    def merge() -> list[Any]:
        nonlocal metadata
        plans, metadata = planner.create_global_plan(local_plans)
        return writer.prepare_global_plan(plans)

    if rank == 0:
        global_plans = _outcome(merge)
    global_plans = _raise_failures([_from_root(global_plans, size, "global plan")])[0]

    def write() -> Any:
        pending = writer.write_data(planner.finish_plan(global_plans[rank]), planner)
        pending.wait()
        return pending.value()

    def finish(results: list[Any]) -> None:
        writer.finish(metadata=metadata, results=results)
        torch.save(meta, writing / LIGHTNING_META_FILE)
        _replace(writing, target)

    def write_and_finish() -> None:
        results = _everyone(write, size, "write")
        done: Any = _outcome(lambda: finish(results)) if rank == 0 else None
        _raise_failures([_from_root(done, size, "finish")])

    if not background:
        write_and_finish()
        return None
    return PendingSave(write_and_finish, target)


class PendingSave:
    """A checkpoint whose files a thread writes (``save_dcp(background=True)``). The thread is not a daemon: a
    process that ends meanwhile waits for it, and so for the other workers' writes, before it exits."""

    def __init__(self, work: Callable[[], None], target: Path) -> None:
        self.target = target
        self._failure: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as error:  # kept for ``wait``, which raises it in the training thread
                self._failure = error

        self._thread = threading.Thread(target=run, name=f"hvd_plugins checkpoint {target.name}", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Until the checkpoint is in place on every worker; a failure of the write raised here."""
        self._thread.join()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise SaveFailed(f"writing the checkpoint {str(self.target)!r} in the background failed: {failure}")


def staged(value: T) -> T:
    """``value`` with every tensor (and each ``FlatPieces``' values) copied into host memory of its own, the rest
    of its dicts and lists copied too: what training changes next does not reach a checkpoint being written."""
    found: Any = value
    if isinstance(value, FlatPieces):
        shard = value.shard
        found = FlatPieces(LocalShard(shard.values.detach().to("cpu", copy=True), shard.start, shard.shape))
    elif isinstance(value, torch.Tensor):
        found = value.detach().to("cpu", copy=True)
    elif isinstance(value, dict):
        found = {key: staged(item) for key, item in value.items()}
    elif isinstance(value, list | tuple):
        found = type(value)(staged(item) for item in value)
    return found


def _replace(written: Path, target: Path) -> None:
    """``written`` (complete) put where ``target`` is: the old one is moved aside first and removed last, so a good
    checkpoint stands at ``target`` or beside it at every moment; earlier saves' leftovers are removed."""
    aside = target.parent / f".{target.name}.replaced"
    _remove(aside)
    if target.exists():
        target.rename(aside)
    written.rename(target)
    _remove(aside)
    for stale in target.parent.glob(f".{target.name}.writing-*"):
        _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


class _Failure:
    """What a worker sends in place of its result when its part of the save raised."""

    def __init__(self, error: BaseException) -> None:
        self.text = f"{type(error).__name__}: {error}"


def _outcome(step: Callable[[], T]) -> T | _Failure:
    try:
        return step()
    except Exception as error:  # sent to every worker, raised there
        return _Failure(error)


def _everyone(step: Callable[[], T], size: int, what: str) -> list[T]:
    """Each worker's result of ``step``, on every worker; a failure anywhere raised everywhere."""
    mine = _outcome(step)
    if size == 1:
        return _raise_failures([mine])
    everyone: list[Any] = horovod_torch().allgather_object(mine, name=f"hvd_plugins.dcp.save.{what}")
    return _raise_failures(everyone)


def _from_root(value: T, size: int, what: str) -> T:
    if size == 1:
        return value
    result: T = horovod_torch().broadcast_object(value, root_rank=0, name=f"hvd_plugins.dcp.save.{what}")
    return result


def _raise_failures(results: list[Any]) -> list[Any]:
    failed = [(rank, result.text) for rank, result in enumerate(results) if isinstance(result, _Failure)]
    if failed:
        ranks = ", ".join(f"rank {rank}: {text}" for rank, text in failed[:4])
        raise SaveFailed(
            f"saving the checkpoint failed on {len(failed)} worker(s) ({ranks}); the last checkpoint "
            "saved is left as it was"
        )
    return results
