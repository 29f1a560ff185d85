"""What both HorovodStrategy classes, the Trainer's and Fabric's, do alike: start Horovod, device, checkpoint IO,
collectives.

A mixin placed before Lightning's ``ParallelStrategy`` (of either Lightning package) in each class;
it relies on what that base provides (``world_size``, ``global_rank``, ``parallel_devices``, ``local_rank``,
``num_nodes``) and on the strategy's ``config``, ``_environment`` and ``_guards`` (the watchdog that bounds
waits). It also holds the one rule of both faces for an elastic reset (``forget_world``).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
from lightning.fabric import __version__ as lightning_version
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.runner import local_launch_size
from hvd_plugins.core.backend.startup import init_horovod
from hvd_plugins.core.checkpoint.dcp_read import (
    as_lightning_checkpoint,
    by_parameter_index,
    by_parameter_name,
    read_dcp,
    saved_names,
)
from hvd_plugins.core.checkpoint.dcp_source import DcpSource, read_model
from hvd_plugins.core.checkpoint.dcp_write import PendingSave, save_dcp
from hvd_plugins.core.comm import collectives
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.comm.shards import LocalShard
from hvd_plugins.core.comm.topology import Topology
from hvd_plugins.core.compiled_graphs import GraphCuts
from hvd_plugins.core.config import HorovodConfig
from hvd_plugins.core.elastic.reset import sync_after_reset
from hvd_plugins.core.placement import ModelPlacement, placement_for
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.sync.guards import SyncGuards
from hvd_plugins.core.sync.parts import is_parts_marker, read_parts_beside, write_parts_beside
from hvd_plugins.core.sync.table import make_gradient_sync
from hvd_plugins.core.training_state import broadcast_optimizer_state_
from hvd_plugins.core.worker import prepare_worker
from hvd_plugins.fabric.lightning_internals import given_checkpoint_io, optimizers_to_device, set_checkpoint_io
from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment
from hvd_plugins.fabric.plugins.io.atomic import AtomicCheckpointIO

T = TypeVar("T")

CHECKPOINT_KEY = "hvd_plugins"
"""Where the strategy keeps its gradient sync's state (DASO's schedule, the measured route) in a checkpoint."""


class HorovodStrategyShared(ABC):
    """Starting Horovod, device, checkpoint IO, Horovod collectives and elastic resets, alike for the Trainer and
    for Fabric."""

    config: HorovodConfig
    gradient_sync: GradientSync | None
    _restored_sync_state: dict[str, Any]  # for the gradient sync the next setup builds
    comm_counters: CommCounters
    _environment: HorovodEnvironment
    _guards: SyncGuards
    world_size: int
    global_rank: int
    local_rank: int
    num_nodes: int
    parallel_devices: list[torch.device] | None
    _committing_now = False  # inside ``_committing``: an elastic commit asks for the state
    _pending_save: PendingSave | None = None  # a DCP checkpoint a thread writes (``async_save``)
    _graph_cuts: GraphCuts

    def _plan_launch(self) -> None:
        """When the Trainer or Fabric is built: start Horovod now (for rank-zero output), unless this process
        starts the workers itself (``python train.py`` with ``devices=N``), which its launcher does later."""
        devices, nodes, front = self.parallel_devices or [], self.num_nodes, self._environment.front
        self._environment.launch_size = local_launch_size(devices, nodes, front)
        if not self._environment.launch_size:
            init_horovod(self.config)

    def _start_worker(self) -> ModuleType:
        """In every worker, before any collective: Horovod running, the watchdog on, devices checked, worker ready."""
        hvd = init_horovod(self.config)
        self._guards.start_watching(hvd.rank(), hvd.size())
        assert self.parallel_devices is not None
        devices, local_size = len(self.parallel_devices), hvd.local_size()
        on_gpu = self.parallel_devices[0].type == "cuda"
        self._environment.validate_settings(
            num_devices=local_size if on_gpu and devices >= local_size else devices, num_nodes=self.num_nodes
        )
        prepare_worker(self.config, hvd, self.root_device)
        return hvd

    def _settle_earlier_backward(self, optimizers: Sequence[Optimizer]) -> None:
        """Before a backward: complete what an earlier backward of this step started (accumulating without
        ``no_backward_sync``, or several ``manual_backward`` calls before a step), bounded like every wait."""
        self._guards.new_backward()  # the gradients it adds are averaged anew
        if self.gradient_sync is None:
            return
        for optimizer in optimizers:
            with self._guards.waiting("gradient allreduce"):
                self.gradient_sync.before_backward(optimizer)

    def average_as_backward_ends(
        self,
        optimizers: Sequence[Optimizer],
        average: Callable[[Optimizer], None] | None = None,
        where: Callable[[], str] = lambda: "after a backward",
    ) -> None:
        """After a backward outside an accumulation: average each optimizer it gave gradients to now (``average``, or
        the guarded sync), as DDP's backward leaves them averaged, so torch's own clipping before the step reads the
        average (under ``shard="parameters"``, the parameters' gradient shards: ``averages_after_backward``)."""
        sync = self.gradient_sync
        if sync is None or not self.config.averages_after_backward:
            return
        for optimizer in optimizers:
            if not sync.started(optimizer):
                continue
            if average is not None:
                average(optimizer)
            else:
                self._guards.after_backward(sync, optimizer, where)

    def _build_gradient_sync(self, precision: object) -> GradientSync:
        """The sync mode of the config, for a model on this worker's device trained under Lightning's ``precision``
        plugin, with the state a checkpoint or a reset left (node-aware modes learn the layout: a collective)."""
        name = getattr(precision, "precision", None)
        sync = make_gradient_sync(self.config, self.comm_counters, self.root_device, name)
        sync.load_state_dict(self._restored_sync_state)
        return sync

    # ------------------------------------------------------------------ elastic resets
    def forget_world(self) -> None:
        """After an elastic reset, in both faces: rank-zero output and the watchdog follow this worker's new rank,
        and the gradient sync is built again only if the old world shaped it (``core.elastic.reset``)."""
        rank, size = self.global_rank, self.world_size
        self._pending_save = None  # its world is gone: the last checkpoint put in place stays the last
        self._follow_rank(rank)
        self._guards.follow_world(rank, size)
        self.gradient_sync, state = sync_after_reset(self.gradient_sync, self._synced_optimizers())
        if state is not None:
            self._restored_sync_state = state

    def _follow_rank(self, rank: int) -> None:
        """Lightning's rank-zero output on this rank (one flag for both Lightning faces: Lightning's own way)."""
        rank_zero_only.rank = rank  # type: ignore[attr-defined]

    @abstractmethod
    def _synced_optimizers(self) -> Sequence[Optimizer]:
        """The optimizers the gradient sync was set up with."""

    # ------------------------------------------------------------------ state for callbacks
    @property
    def topology(self) -> Topology | None:
        """Which workers share a node, with a node-aware sync once it is set up (else None)."""
        return self.gradient_sync.topology if self.gradient_sync is not None else None

    def local_shards(self) -> dict[str, LocalShard]:
        """This worker's part of each parameter under ``shard="parameters"``, by state dict name, after setup: views
        of the slices its optimizer steps, with where each starts in the flattened parameter and its whole shape.
        No collective and no copy (``model.state_dict()`` gathers the whole tensors instead)."""
        if self.gradient_sync is None:
            raise RuntimeError("local_shards: nothing is set up yet; call it after the strategy set the model up")
        return self.gradient_sync.local_shards()

    def _share_loaded_optimizer_states(self, optimizers: Sequence[Optimizer], prefix: str = "opt") -> None:
        """After a load: rank 0's optimizer states everywhere, where every worker holds the whole state (a sharded
        mode's workers each kept their slices of the same loaded state instead)."""
        if self.gradient_sync is None or self.gradient_sync.replicates_optimizer_state:
            for index, optimizer in enumerate(optimizers):
                broadcast_optimizer_state_(optimizer, root_rank=0, name=f"{prefix}{index}")

    def _load_optimizer_states(self, optimizers: Sequence[Optimizer], states: Sequence[Any], model: Module) -> None:
        """Each optimizer takes its saved state (whole, or this worker's part) through the sync mode, on this
        worker's device; then rank 0's everywhere, where every worker holds the whole state. A state saved by
        parameter name (DCP's layout) is matched by the names of ``model``'s parameters."""
        for optimizer, saved in zip(optimizers, states, strict=False):
            self._load_optimizer_state(optimizer, saved, model)
        optimizers_to_device(list(optimizers), self.root_device)
        self._share_loaded_optimizer_states(optimizers)

    def _load_optimizer_state(self, optimizer: Optimizer, saved: Any, model: Module) -> None:
        """One optimizer's saved state taken through the sync mode: whole, this worker's part, keyed by the names of
        ``model``'s parameters, or left in a DCP checkpoint (a sharded mode reads only its slices of it)."""
        sync = self.gradient_sync
        if isinstance(saved, DcpSource):
            if sync is not None:
                sync.load_optimizer_pieces(optimizer, model, saved)
                return
            saved = saved.read(lambda path: True)
        state = dict(saved) if is_parts_marker(saved) else by_parameter_index(saved, optimizer, model)
        if sync is None:
            optimizer.load_state_dict(state)
        else:
            sync.load_optimizer_state_dict(optimizer, state)

    # ------------------------------------------------------------------ checkpoints
    def _add_sync_state(self, checkpoint: dict[str, Any]) -> None:
        """Keep the gradient sync's own state (DASO's schedule, the measured route) in ``checkpoint``."""
        if self.gradient_sync is not None and (own := self.gradient_sync.state_dict()):
            checkpoint[CHECKPOINT_KEY] = own

    def _take_sync_state(self, checkpoint: Mapping[str, Any]) -> None:
        """The sync's state from a loaded checkpoint: for the sync built next, and for the running one if any."""
        self._restored_sync_state = dict(checkpoint.get(CHECKPOINT_KEY, {}))
        if self.gradient_sync is not None:
            self.gradient_sync.load_state_dict(self._restored_sync_state)

    def _model_state(self, model: Module | None) -> dict[str, Any]:
        """The model's whole state for a checkpoint, as the sync mode gives it (before a sync exists: the module's)."""
        assert model is not None
        return model.state_dict() if self.gradient_sync is None else self.gradient_sync.model_state_dict(model)

    def _load_model_state(self, model: Module | None, state: Mapping[str, Any] | DcpSource, strict: bool) -> None:
        """A saved model state taken back through the sync mode (before a sync exists: by the module itself)."""
        assert model is not None
        if isinstance(state, DcpSource):  # read in place from the directory, each worker what it holds
            if self.gradient_sync is None:
                read_model(state, model.state_dict(), strict, type(model).__name__)
            else:
                self.gradient_sync.load_model_pieces(model, state, strict)
        elif self.gradient_sync is None:
            model.load_state_dict(state, strict=strict)
        else:
            self.gradient_sync.load_model_state_dict(model, state, strict)

    @property
    def _placement(self) -> ModelPlacement:
        """Whole on every worker, or sharded where it is set up: what the shard mode means for the model itself."""
        return placement_for(self.config)

    @property
    def _writes_dcp(self) -> bool:
        """Whether a checkpoint saved now is a DCP directory, every worker writing its own shards
        (``state_dict_type="sharded"``); an elastic commit keeps its own form in host memory."""
        return self.config.shard_checkpoint == "dcp" and not self._committing_now

    @contextlib.contextmanager
    def _committing(self) -> Iterator[None]:
        """Inside, the state asked for is an elastic commit's (the sync mode's ``committing``), never DCP pieces."""
        self._committing_now = True
        try:
            with self.gradient_sync.committing() if self.gradient_sync is not None else contextlib.nullcontext():
                yield
        finally:
            self._committing_now = False

    def _saved_model_state(self, model: Module | None) -> dict[str, Any]:
        """The model's state for the checkpoint being saved: whole (``_model_state``), or this worker's pieces of it
        for a DCP checkpoint (no gather: ``GradientSync.model_pieces``)."""
        assert model is not None
        if not self._writes_dcp:
            return self._model_state(model)
        return model.state_dict() if self.gradient_sync is None else self.gradient_sync.model_pieces(model)

    def _saved_optimizer_state(self, optimizer: Optimizer, model: Module | None) -> dict[str, Any]:
        """An optimizer's state for the checkpoint being saved: as the sync mode gives it (sharded: gathered whole,
        or parts), or for a DCP checkpoint this worker's pieces, keyed by the names of ``model``'s parameters."""
        sync = self.gradient_sync
        if not self._writes_dcp:
            return sync.optimizer_state_dict(optimizer) if sync is not None else optimizer.state_dict()
        names = saved_names(model or Module())
        if sync is None:
            return by_parameter_name(optimizer.state_dict(), optimizer, names)
        return sync.optimizer_pieces(optimizer, names)

    def _write_dcp(self, path: Any, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        """``tensors`` written by every worker into the DCP directory ``path``, ``meta`` beside them (``dcp_write``),
        bounded like every wait; with ``async_save``, by a thread, once the last save's thread is done."""
        self._finish_pending_save()
        with self._guards.waiting("saving a sharded checkpoint"):
            background = self.config.async_save
            self._pending_save = save_dcp(path, tensors, meta, self.global_rank, self.world_size, background)

    def wait_for_checkpoint(self) -> None:
        """Until the checkpoint a thread writes (``async_save=True``) is in place on every worker (a collective: call
        it on every worker). The next save, a load, teardown and the process's exit wait for it anyway."""
        self._finish_pending_save()

    def _finish_pending_save(self) -> None:
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            with self._guards.waiting("writing a sharded checkpoint in the background"):
                pending.wait()

    def _stop_watching(self) -> None:
        """At teardown, in both faces: the checkpoint being written finished, then no wait bounded, no graph cut."""
        try:
            self._finish_pending_save()
        finally:
            self._guards.stop_checking()
            self._graph_cuts.close()

    def _write_trainer_dcp(self, checkpoint: dict[str, Any], filepath: Any) -> bool:
        """A Trainer checkpoint as Lightning's sharded FSDP writes it, when DCP is the form: the model under
        ``model``, each optimizer under ``optimizer_<index>``, the rest in ``meta.pt``. Returns whether it wrote."""
        if not self._writes_dcp:
            return False
        meta = dict(checkpoint)
        tensors = {"model": meta.pop("state_dict")}
        tensors.update({f"optimizer_{index}": state for index, state in enumerate(meta.pop("optimizer_states", []))})
        self._write_dcp(filepath, tensors, meta)
        return True

    def _write_optimizer_parts(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Optimizer states a sharded mode gave as this worker's parts (``shard_checkpoint="parts"``): every worker
        writes its own beside ``filepath``; the checkpoint (written by rank 0) keeps a marker in their place."""
        write_parts_beside(checkpoint, filepath, self.checkpoint_io.save_checkpoint)

    def _read_checkpoint(self, filepath: Any, read_file: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A Trainer checkpoint: a directory torch's distributed checkpointing wrote, read whole on this worker
        (``dcp_read``) in the layout Lightning restores; else the file ``read_file`` reads, with the optimizer
        states of a checkpoint saved in parts: this worker's own part where the workers are as many as when it was
        saved, else the whole states, consolidated from every part."""
        self._finish_pending_save()
        if Path(filepath).is_dir():  # the model and optimizers left on disk, read in place when loaded
            return as_lightning_checkpoint(read_dcp(filepath, lazy=lightning_tensors), lightning_version)
        checkpoint = read_file()
        read_parts_beside(checkpoint, filepath, self.world_size, self.global_rank)
        return checkpoint

    @property
    def daso_sync(self) -> Any:
        """With ``sync="daso"`` the running fit's DasoParameterSync (its ``schedule`` holds phase, history)."""
        return getattr(self.gradient_sync, "daso", None)

    @property
    def route_tuner(self) -> Any:
        """With ``sync="hierarchical"``, the route its large buckets took and what was measured; else None."""
        return getattr(self.gradient_sync, "route_tuner", None)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Atomic writes unless a CheckpointIO was given (here or as a plugin)."""
        io = given_checkpoint_io(self)
        if io is None:
            io = AtomicCheckpointIO()
            set_checkpoint_io(self, io)
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        set_checkpoint_io(self, io)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        device = self.parallel_devices[0]
        return torch.device("cuda", self.local_rank) if device.type == "cuda" else device

    def _reduce_over_workers(self, method: str, tensor: Tensor | Any, group: Any | None, reduce_op: Any) -> Any:
        if not isinstance(tensor, Tensor) or self.world_size == 1:
            return tensor
        collectives.require_whole_world(method, group)
        return collectives.reduce_in_place(tensor, reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from every worker along a new first dimension."""
        collectives.require_whole_world("all_gather", group)
        return tensor.unsqueeze(0) if self.world_size == 1 else collectives.gather_stacked(tensor, sync_grads)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj if self.world_size == 1 else collectives.broadcast_object(obj, src)

    def barrier(self, name: str | None = None) -> None:
        if self.world_size > 1 and horovod_torch().is_initialized():
            with self._guards.waiting(f"barrier {name or ''}".strip()):
                horovod_torch().barrier()


def lightning_tensors(key: str) -> bool:
    """The keys of a Trainer's DCP checkpoint that hold the model and the optimizers (Lightning's sharded layout, or
    a plain ``dcp.save`` of ``{"model": ..., "optim": ...}``)."""
    return key in ("model", "optim", "optimizer") or key.startswith("optimizer_")
