"""``Fabric(strategy="horovod")``: Horovod for loops people write themselves, on the core the Trainer strategy uses.

Fabric calls ``backward``, then (maybe) ``clip_gradients``, then ``optimizer.step()``. A backward's
gradients are averaged as it ends, once per optimizer it gave gradients to, as DDP's backward leaves
them averaged: code that reads or clips them with torch's own tools before the step sees the average
(``op="sum"`` sums at the first of the clip or the step instead: ``HorovodConfig.averages_after_backward``).
With Horovod's DistributedOptimizer (flat sync) the allreduces start during backward and are waited
for then; ``fabric.no_backward_sync`` holds them back for the micro-batches of an accumulation, so one
allreduce per parameter and step remains. The two-level sync averages at that moment, in buckets.

DASO is a Trainer feature (its schedule follows epochs and the loss the Trainer averages); here
``sync="daso"`` is refused at construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.distributed import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from hvd_plugins.core.backend import capabilities
from hvd_plugins.core.backend import optimizer as horovod_optimizer
from hvd_plugins.core.backend.startup import init_horovod
from hvd_plugins.core.checkpoint.dcp_read import read_dcp, restore
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.compiled_graphs import GraphCuts
from hvd_plugins.core.config import (
    CompressionName,
    CpuThreads,
    GradientOp,
    HierarchicalImpl,
    HorovodConfig,
    Megabytes,
    ParamDtypeArgument,
    Shard,
    StallTimeout,
    StateDictType,
    SyncMode,
    UnitPolicy,
)
from hvd_plugins.core.recompute import checkpoint_activations
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.sync.guards import SyncGuards
from hvd_plugins.core.training_state import (
    broadcast_optimizer_state_,
    move_module_,
    param_groups_kept,
    wrap_optimizers,
)
from hvd_plugins.fabric.lightning_internals import (
    BackwardSyncControl,
    CheckpointPath,
    fabric_optimizer_target,
    set_backward_sync_control,
    set_launcher,
)
from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment
from hvd_plugins.fabric.strategies.launchers.horovod import HorovodFabricLauncher
from hvd_plugins.fabric.strategies.shared import HorovodStrategyShared


class _HoldAllreduces(BackwardSyncControl):
    """``fabric.no_backward_sync``: the backward inside adds to the gradients and starts no allreduce."""

    def __init__(self, strategy: HorovodStrategy) -> None:
        self.strategy = strategy

    @override
    @contextlib.contextmanager
    def no_backward_sync(self, module: Module, enabled: bool = True) -> Generator[None, None, None]:
        # Fabric before 2.4 calls this only to skip, without ``enabled``
        holding, self.strategy.holding = self.strategy.holding, enabled or self.strategy.holding
        try:
            yield
        finally:
            self.strategy.holding = holding


class HorovodStrategy(HorovodStrategyShared, ParallelStrategy):
    """Data-parallel training over Horovod for Lightning Fabric (Gloo or MPI controller; NCCL on GPUs).

    Args:
        compression: ``"none"``, ``"fp16"`` or ``"bf16"``: gradients on the wire.
        op: ``"average"``, ``"sum"`` or ``"adasum"`` (MPI builds only; no accumulation).
        gradient_predivide_factor: divide before the sum, the rest after (``op="average"``, flat sync).
        sparse_as_dense: send sparse gradients (``nn.Embedding(sparse=True)``) dense: one allreduce, not two allgathers.
        sync: ``"allreduce"`` (flat) or ``"hierarchical"`` (inside each node, then across nodes).
        shard: ``"none"``; ``"optimizer"`` (ZeRO-1), ``"gradients"`` (ZeRO-2) or ``"parameters"`` (ZeRO-3) split
            those over the workers.
        auto_wrap_policy: with ``shard="parameters"``, the module classes (or a function of a module) that are units.
        reshard_after_forward: with ``shard="parameters"``, free a unit's parameters after its forward (default).
        param_dtype: with ``shard="parameters"``, gather units in this dtype to compute: ``"auto"`` (bf16 under
            ``precision="bf16-mixed"`` on GPUs), ``"full"``/None, ``"bf16"``/``torch.bfloat16``, ``"fp16"``.
        activation_checkpointing_policy: modules (classes) whose activations backward recomputes instead of keeping.
        state_dict_type: ``"full"``: ``fabric.save`` writes one file, rank 0 holding the whole state; ``"sharded"``:
            a directory in torch's distributed checkpoint format (DCP), every worker writing its own shards.
        async_save: with ``state_dict_type="sharded"``, ``fabric.save`` returns once each worker has copied its
            shards into host memory; a thread writes them (the next save, and teardown, wait for it).
        hierarchical_impl: ``"portable"`` (every build) or ``"native"`` (MPI + NCCL only).
        compress_node_local: with ``sync="hierarchical"``, compress the node-local legs too.
        bucket_mb: gradient bucket size of the two-level sync, in MiB.
        flat_below_mb: with ``sync="hierarchical"``, buckets under this many MiB take one flat allreduce.
        stall_timeout_seconds: a worker waiting this long in a gradient allreduce or barrier ends the job.
        cpu_threads: torch's threads per worker; ``"auto"``: the host's cores shared among its workers.
        accelerator: Lightning's; Fabric sets it from ``Fabric(accelerator=...)``.
        parallel_devices: Lightning's; Fabric sets it from ``Fabric(devices=...)``.
        checkpoint_io: how checkpoints are written; ``None``: ``AtomicCheckpointIO`` (temporary file, fsync, rename).
        precision: Lightning's precision plugin; Fabric sets it from ``Fabric(precision=...)``.

    ``sync="daso"`` raises ``ValueError``: DASO's schedule follows epochs, which only the Trainer knows.
    The same names mean the same as in the Trainer's ``HorovodStrategy`` (see ``HorovodConfig``).
    """

    strategy_name = "horovod"

    def __init__(
        self,
        compression: CompressionName = "none",
        op: GradientOp = "average",
        gradient_predivide_factor: float = 1.0,
        sparse_as_dense: bool = False,
        sync: SyncMode = "allreduce",
        shard: Shard = "none",
        auto_wrap_policy: UnitPolicy = None,
        reshard_after_forward: bool = True,
        param_dtype: ParamDtypeArgument = "auto",
        activation_checkpointing_policy: UnitPolicy = None,
        state_dict_type: StateDictType = "full",
        async_save: bool = False,
        hierarchical_impl: HierarchicalImpl = "portable",
        compress_node_local: bool = False,
        bucket_mb: float = 32.0,
        flat_below_mb: Megabytes = "auto",
        stall_timeout_seconds: StallTimeout = "auto",
        cpu_threads: CpuThreads = "auto",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        if sync == "daso":
            raise ValueError(
                "sync='daso' is not available with Fabric: DASO's schedule follows training epochs and the "
                "epoch loss, which only the Trainer knows. Use sync='hierarchical' or 'allreduce' here, or "
                "the Trainer's HorovodStrategy(sync='daso')."
            )
        if sync not in FABRIC_SYNC_MODES:
            raise ValueError(f"sync={sync!r} is not supported with Fabric; choose one of {list(FABRIC_SYNC_MODES)}")
        self._environment = HorovodEnvironment(front="Fabric")
        super().__init__(accelerator, parallel_devices, self._environment, checkpoint_io, precision)
        self.config = HorovodConfig.build(
            compression=compression,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            sparse_as_dense=sparse_as_dense,
            sync=sync,
            shard=shard,
            auto_wrap_policy=auto_wrap_policy,
            reshard_after_forward=reshard_after_forward,
            param_dtype=param_dtype,
            activation_checkpointing_policy=activation_checkpointing_policy,
            state_dict_type=state_dict_type,
            async_save=async_save,
            hierarchical_impl=hierarchical_impl,
            compress_node_local=compress_node_local,
            bucket_mb=bucket_mb,
            flat_below_mb=flat_below_mb,
            stall_timeout_seconds=stall_timeout_seconds,
            cpu_threads=cpu_threads,
            average_buffers=False,  # no epochs here; Fabric loops average what they need with all_reduce
            auto_requeue=False,
        )
        capabilities.require_build_supports(self.config)
        self._num_nodes = 1  # set by Fabric's connector
        self.comm_counters = CommCounters()
        self.gradient_sync: GradientSync | None = None  # built at the first setup (node-aware: a collective)
        self._restored_sync_state: dict[str, Any] = {}  # for a sync built again after an elastic reset
        self._guards = SyncGuards(self.config)
        self._graph_cuts = GraphCuts(self.config.bucket_bytes)  # a compiled module's graphs end at gradient buckets
        set_backward_sync_control(self, _HoldAllreduces(self))
        self._wrapped: list[Optimizer] = []  # every optimizer set up so far, in order (names opt0, opt1, ...)
        self._sharded_module: Module | None = None  # shard="parameters": the module the sync shards
        self._averaged: set[int] = set()  # optimizers whose gradients are averaged for the coming step
        self.holding = False  # inside no_backward_sync: backward only accumulates

    # ------------------------------------------------------------------ plumbing
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        return {"num_replicas": self.world_size, "rank": self.global_rank} if self.world_size > 1 else None

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    def _set_world_ranks(self) -> None:
        """Fabric's connector calls this by name once the strategy is chosen: Horovod starts, output follows rank."""
        self._plan_launch()
        self._follow_rank(self.global_rank)

    @override
    def _configure_launcher(self) -> None:
        size = self._environment.launch_size
        set_launcher(self, HorovodFabricLauncher(size, partial(init_horovod, self.config)) if size else None)

    @override
    def setup_environment(self) -> None:
        self._start_worker()
        super().setup_environment()

    @override
    def module_to_device(self, module: Module) -> None:
        move_module_(module, self.root_device)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()`` with ``shard="parameters"`` builds on the meta device (unless ``empty_init=False``):
        each worker makes only its slices real at ``fabric.setup``."""
        if not self._placement.builds_on_meta(empty_init):
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    # ------------------------------------------------------------------ setup
    @override
    def setup_module(self, module: Module) -> Module:
        """Every worker starts from rank 0's parameters and buffers. Until teardown, graphs that ``torch.compile``
        captures (``fabric.setup`` compiles the module again after this when it was given compiled) end where a
        gradient bucket fills, so the syncs that backward's hooks start overlap the rest of backward.

        With ``shard="parameters"`` the module is sharded right here, as FSDP's ``fully_shard`` shards it: a model
        built on the meta device is made real a unit at a time and never whole on a worker, and from now on
        ``module.parameters()`` are this worker's shards. An optimizer set up later over them
        (``fabric.setup_optimizers``, the order litgpt and Lightning's FSDP guide use) takes the units over one at a
        time."""
        module = self._setup_module(module)
        self._placement.set_up_alone(lambda: self._wrap([], module))
        return module

    def _setup_module(self, module: Module) -> Module:
        """As ``setup_module``, short of sharding it: placed (``ModelPlacement.prepare``), its activations
        checkpointed as asked, ``torch.compile``'s graphs cut at gradient buckets."""
        checkpoint_activations(module, self.config.activation_checkpointing_policy)
        self._placement.prepare(module, self.root_device)
        self._sharded_module = self._placement.sharded_model(module)
        self._graph_cuts.open()
        return module

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], *scheduler: Any
    ) -> tuple[Any, ...]:
        """Rank 0's module everywhere, each optimizer wrapped; ``scheduler`` (Fabric 2.4 added it) now drives the
        wrapped optimizer it was built on."""
        module = self._setup_module(module)
        schedulers = [given for given in scheduler if given is not None]
        return (module, self._wrap(optimizers, module, schedulers), *scheduler)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer set up without its module (``fabric.setup_optimizers``): positional allreduce names. With
        ``shard="parameters"`` the module set up before it is sharded for it here."""
        module = self._sharded_module
        return self._wrap([optimizer], module if module is not None else Module())[0]

    def _wrap(self, optimizers: list[Optimizer], module: Module, schedulers: Sequence[Any] = ()) -> list[Optimizer]:
        self._placement.before_optimizers(module)
        if self.gradient_sync is None:
            self.gradient_sync = self._build_gradient_sync(self.precision)  # a collective
        self.gradient_sync.refuse_grad_scaler(getattr(self.precision, "scaler", None))
        first = len(self._wrapped)
        wrapped = wrap_optimizers(self.gradient_sync, optimizers, module, schedulers, first_index=first)
        for index, optimizer in enumerate(wrapped, start=first):
            if self.gradient_sync.replicates_optimizer_state:  # a sharded optimizer holds no state to send yet
                broadcast_optimizer_state_(optimizer, root_rank=0, name=f"opt{index}")
            horovod_optimizer.make_zero_grad_wrapper_safe(optimizer, fabric_optimizer_target)
        self._wrapped += wrapped
        self.gradient_sync.setup(module, wrapped, total_epochs=None)
        return wrapped

    # ------------------------------------------------------------------ stepping
    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """New gradients: each optimizer averages again at its next clip or step; none inside no_backward_sync."""
        self._settle_earlier_backward(self._wrapped)  # refuses a second ZeRO-3 backward before the step
        if self.holding and self.gradient_sync is not None:
            for optimizer in self._wrapped:
                self.gradient_sync.hold_next_backward(optimizer)  # this backward only accumulates
        self._averaged.clear()
        super().backward(tensor, module, *args, **kwargs)
        if not self.holding:
            self.average_as_backward_ends(self._wrapped, self._average)

    def _average(self, optimizer: Optimizer) -> None:
        """Average ``optimizer``'s gradients over every worker, once per step (at its clip or its step)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
        if self.gradient_sync is None or id(optimizer) in self._averaged:
            return
        with self._guards.waiting("gradient allreduce"):
            self.gradient_sync.synchronize(optimizer)
        self._averaged.add(id(optimizer))

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        inner = getattr(optimizer, "optimizer", optimizer)
        self._average(inner)
        self._averaged.discard(id(inner))
        if self.gradient_sync is None:
            return super().optimizer_step(optimizer, **kwargs)
        with self.gradient_sync.deferred(inner):
            return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clips the averaged gradients by their norm over every worker's, as one process with the whole batch would."""
        self._average(optimizer)
        if self.gradient_sync is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        inner = fabric_optimizer_target(optimizer)
        return self.gradient_sync.clip_grad_norm_(inner, float(max_norm), float(norm_type), error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._average(optimizer)
        if self.gradient_sync is None:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self.precision.unscale_gradients(optimizer)
        return self.gradient_sync.clip_grad_value_(fabric_optimizer_target(optimizer), float(clip_val))

    # ------------------------------------------------------------------ checkpoints
    @override
    def load_checkpoint(  # type: ignore[override]
        self,
        path: CheckpointPath,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Load on every worker, then take rank 0's modules and optimizer states, so all continue alike. A directory
        is read as torch's distributed checkpointing wrote it (FSDP2's ``dcp.save``, Lightning's sharded FSDP
        checkpoints), whole on every worker, at any number of workers (``core.checkpoint.dcp_read``)."""
        self._finish_pending_save()
        with param_groups_kept(self._wrapped):
            if Path(path).is_dir():  # modules and optimizers read in place, each worker what it holds
                given = state if isinstance(state, dict) else {}
                lazy = {key for key, obj in given.items() if isinstance(obj, Module | Optimizer)}
                checkpoint = read_dcp(path, lazy=lazy.__contains__)
                remainder = restore(
                    state or {}, checkpoint, strict, self.load_module_state_dict, self._load_optimizer_state
                )
            else:
                remainder = super().load_checkpoint(path, state, strict, **kwargs)  # weights_only since Fabric 2.4
        objects = state.values() if isinstance(state, dict) else [state] if state is not None else []
        for obj in objects:
            if isinstance(obj, Module):
                self._placement.after_load(obj)
            elif isinstance(obj, Optimizer) and self._replicates_optimizer_state:
                inner = getattr(obj, "optimizer", obj)
                index = next((i for i, o in enumerate(self._wrapped) if o is inner), len(self._wrapped))
                broadcast_optimizer_state_(inner, root_rank=0, name=f"loaded_opt{index}")
        return remainder

    @override
    def save_checkpoint(
        self,
        path: CheckpointPath,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """With ``state_dict_type="sharded"``: a DCP directory, as Lightning's ``FSDPStrategy`` writes it, every
        worker writing its own shards of the modules and optimizers (no gather), the rest in ``meta.pt``."""
        if not self._writes_dcp:
            return super().save_checkpoint(path, state, storage_options, filter)
        model = next((obj for obj in state.values() if isinstance(obj, Module)), self._sharded_module)
        tensors: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                target, value = tensors, self._saved_model_state(obj)
            elif isinstance(obj, Optimizer):
                target, value = tensors, self._saved_optimizer_state(obj, model)
            else:
                target, value = meta, obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
            keep = (filter or {}).get(key)
            target[key] = {k: v for k, v in value.items() if keep(k, v)} if keep is not None else value
        self._write_dcp(path, tensors, meta)
        return None

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return self._model_state(module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        self._load_model_state(module, state_dict, strict)

    @property
    def _replicates_optimizer_state(self) -> bool:
        """Whether every worker holds the whole optimizer state (else each keeps its slices of what it loaded)."""
        return self.gradient_sync is None or self.gradient_sync.replicates_optimizer_state

    # ------------------------------------------------------------------ collectives
    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Any:
        return self._reduce_over_workers("all_reduce", tensor, group, reduce_op)

    @override
    def forget_world(self) -> None:
        """After an elastic reset (``hvd_plugins.fabric.ElasticLoop``): the rule of both faces, and no step's
        gradients counted as averaged."""
        super().forget_world()
        self._averaged.clear()

    @override
    def _synced_optimizers(self) -> Sequence[Optimizer]:
        return self._wrapped

    @override
    def teardown(self) -> None:
        self._stop_watching()
        if self.gradient_sync is not None:
            self.gradient_sync.teardown(self._wrapped)
        super().teardown()


FABRIC_SYNC_MODES = ("allreduce", "hierarchical")
"""The sync modes Fabric takes (DASO needs the Trainer's epochs)."""
