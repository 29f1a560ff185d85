"""HorovodStrategy: the one place that talks to Lightning's Trainer.

It wires algorithms from ``comm`` and ``daso`` into Lightning's hooks; it does not implement
them. Launch with ``horovodrun -np N python train.py`` or run as a single plain process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from hvd_plugins._hooks import StrategyLoopHooks
from hvd_plugins._horovod import horovod_torch
from hvd_plugins.checkpoint_io import AtomicCheckpointIO
from hvd_plugins.comm.compression import compressor_by_name
from hvd_plugins.comm.counters import CommCounters, Scope
from hvd_plugins.comm.gradient_sync import (
    REDUCE_OPS,
    GradientSync,
    HierarchicalGradientSync,
    HorovodOptimizerSync,
    NoGradientSync,
)
from hvd_plugins.comm.naming import COLLECTIVE_NAMES
from hvd_plugins.comm.topology import NodeGroups, Topology, build_node_groups, discover_topology
from hvd_plugins.config_check import assert_ranks_agree
from hvd_plugins.daso.config import DasoConfig
from hvd_plugins.environment import HorovodEnvironment
from hvd_plugins.faults import (
    CollectiveWatchdog,
    FiniteGradientCheck,
    apply_stall_timeout,
    optimizer_fingerprint,
    report_failure,
    require_gpu_build,
    require_gpu_for_local_rank,
    require_no_grad_scaler,
    validate_stall_timeout,
)
from hvd_plugins.metrics_sync import attach_horovod_metric_sync
from hvd_plugins.sync_batchnorm import convert_sync_batchnorm
from hvd_plugins.training_state import average_buffers_, broadcast_optimizer_state_, named_parameters_for

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from hvd_plugins.daso.sync import DasoSync

SYNC_MODES = ("allreduce", "hierarchical", "daso")
HIERARCHICAL_IMPLS = ("process_sets", "native")
_REDUCE_OP_NAMES = {"mean": "average", "avg": "average", "average": "average", "sum": "sum", "max": "max", "min": "min"}


def _choice(argument: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{argument}={value!r} is not supported; choose one of {list(allowed)}")
    return value


class HorovodStrategy(ParallelStrategy):
    """Data-parallel training over Horovod (Gloo or MPI controller; NCCL on GPUs).

    Args:
        compression: ``"none"`` or ``"fp16"``: what gradients look like on the wire. DASO's cross-node
            parameters follow ``DasoConfig.downcast`` instead (fp16 by default).
        op: ``"average"``, ``"sum"`` or ``"adasum"`` (Adasum needs a Horovod built with MPI).
        gradient_predivide_factor: divide gradients by this before the sum and by ``size/factor``
            after; only with ``op="average"``.
        scale_lr: multiply every learning rate (and schedulers' base lrs) by the number of workers.
            Off by default: nothing is changed behind your back.
        sync: ``"allreduce"`` (flat), ``"hierarchical"`` (inside the node, then across nodes) or
            ``"daso"`` (inside the node every step, across nodes every few steps).
        hierarchical_impl: ``"process_sets"`` (works on every build) or ``"native"`` (Horovod's own,
            MPI controller + NCCL only).
        compress_node_local: with ``sync="hierarchical"``, compress the node-local legs too.
        daso: DASO knobs (a ``DasoConfig`` or a dict of its fields); only with ``sync="daso"``.
        sync_batchnorm: convert BatchNorm layers to ``hvd.SyncBatchNorm``
            (``Trainer(sync_batchnorm=True)`` does the same).
        average_buffers: average floating-point buffers (e.g. BatchNorm running stats) over all
            workers at the end of every training epoch, so every rank validates and saves the same model.
        bucket_mb: size of the gradient buckets of the hierarchical allreduce.
        stall_timeout_seconds: a worker that has waited this long in one gradient allreduce or barrier
            (some rank never joined) exits with code 75 and horovodrun stops the others; also exported
            as Horovod's stall-inspector variables before ``hvd.init``. ``None``: wait forever.
            Must exceed the longest legitimate wait between ranks (e.g. rank 0 saving a checkpoint).
        check_finite_gradients: after the gradient average, stop on every rank with
            ``NonFiniteGradientError`` naming the step and the ranks whose gradients were NaN/Inf.
            Costs one small allreduce per step; not with a GradScaler, which skips such steps itself.
    """

    strategy_name = "horovod"

    def __init__(
        self,
        compression: str = "none",
        op: str = "average",
        gradient_predivide_factor: float = 1.0,
        scale_lr: bool = False,
        sync: str = "allreduce",
        hierarchical_impl: str = "process_sets",
        compress_node_local: bool = False,
        daso: DasoConfig | dict[str, Any] | None = None,
        sync_batchnorm: bool = False,
        average_buffers: bool = True,
        bucket_mb: float = 32.0,
        stall_timeout_seconds: float | None = None,
        check_finite_gradients: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=HorovodEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.compression = compressor_by_name(compression).name
        self.op = _choice("op", op, REDUCE_OPS)
        self.sync = _choice("sync", sync, SYNC_MODES)
        self.hierarchical_impl = _choice("hierarchical_impl", hierarchical_impl, HIERARCHICAL_IMPLS)
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a positive number")
        if gradient_predivide_factor != 1.0 and op != "average":
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor!r} works only with op='average', not op={op!r}"
            )
        if op == "adasum" and sync != "allreduce":
            raise ValueError(f"op='adasum' works only with sync='allreduce', not sync={sync!r}")
        if daso is not None and sync != "daso":
            raise ValueError(f"daso={daso!r} was given but sync={sync!r}; DASO settings need sync='daso'")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} must be a positive number of megabytes")
        self.daso_config = DasoConfig.from_any(daso) if sync == "daso" else None
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.scale_lr = bool(scale_lr)
        self.compress_node_local = bool(compress_node_local)
        self.sync_batchnorm = bool(sync_batchnorm)
        self.average_buffers = bool(average_buffers)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.stall_timeout_seconds = validate_stall_timeout(stall_timeout_seconds)
        self.check_finite_gradients = bool(check_finite_gradients)
        self._finite_check: FiniteGradientCheck | None = None
        self._watchdog: CollectiveWatchdog | None = None
        self.num_nodes = 1  # set by the Trainer; checked against the launch in setup_environment
        # Public, read by callbacks: what this worker sent, and (with sync="daso") the schedule owner.
        self.comm_counters = CommCounters()
        self.daso: DasoSync | None = None
        self.topology: Topology | None = None
        self._groups: NodeGroups | None = None
        self._gradient_sync: GradientSync | None = None
        self._backward_passes = 1
        self._stepped_this_batch = False
        if op == "adasum":
            self._require_mpi_for_adasum(initialized=False)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Atomic writes unless a CheckpointIO was given (here or as a Trainer plugin)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    @override
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)
        # Horovod's zero_grad calls ``super(self.__class__, self)``; on a LightningOptimizer (which
        # subclasses the wrapped class) that recurses forever. Pin each LightningOptimizer's
        # zero_grad to the method bound to the Horovod optimizer itself.
        for lightning_optimizer in self._lightning_optimizers:
            lightning_optimizer.zero_grad = lightning_optimizer._optimizer.zero_grad

    # ------------------------------------------------------------------ ranks and devices
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if self.parallel_devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return self.parallel_devices[0]

    @property
    def is_distributed(self) -> bool:
        """Lightning asks this to add a DistributedSampler and to honour ``sync_dist``."""
        return self.world_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def set_world_ranks(self) -> None:
        """Called when the Trainer is built: start Horovod so rank-zero-only output works at once."""
        self._init_horovod()
        rank_zero_only.rank = self.global_rank

    def _init_horovod(self) -> None:
        hvd = horovod_torch()
        node_aware = self.sync in ("hierarchical", "daso")
        native = self.sync == "hierarchical" and self.hierarchical_impl == "native"
        apply_stall_timeout(self.stall_timeout_seconds, horovod_initialized=hvd.is_initialized())
        if hvd.is_initialized():
            if node_aware and not native and os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
                raise RuntimeError(
                    f"sync={self.sync!r} needs Horovod's dynamic process sets, but hvd.init() was already "
                    "called without them. Let the strategy call hvd.init(), or set "
                    "HOROVOD_DYNAMIC_PROCESS_SETS=1 before calling it."
                )
            return
        if node_aware and not native:
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        if native:
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
        hvd.init()

    def _require_mpi_for_adasum(self, initialized: bool) -> None:
        hvd = horovod_torch()
        available = hvd.mpi_enabled() if initialized else hvd.mpi_built()
        if not available:
            raise ValueError(
                "op='adasum' needs Horovod's MPI controller, but this "
                + ("job runs without MPI (launched with --gloo?)" if initialized else "Horovod build has no MPI")
                + ". Use op='average' or 'sum', or build Horovod with MPI (HVD_MPI=yes bash ci/install_horovod.sh)."
            )

    @override
    def setup_environment(self) -> None:
        self._init_horovod()
        hvd = horovod_torch()
        if self.stall_timeout_seconds is not None and self._watchdog is None:
            self._watchdog = CollectiveWatchdog(self.stall_timeout_seconds, hvd.rank(), hvd.size())
        assert self.parallel_devices is not None and self.cluster_environment is not None
        on_gpu = self.parallel_devices[0].type == "cuda"
        devices = len(self.parallel_devices)
        local_size = hvd.local_size()
        self.cluster_environment.validate_settings(
            num_devices=local_size if on_gpu and devices >= local_size else devices, num_nodes=self.num_nodes
        )
        if on_gpu:
            require_gpu_build(hvd)
            require_gpu_for_local_rank(self.local_rank, torch.cuda.device_count(), local_size)
            torch.cuda.set_device(self.root_device)
        if self.op == "adasum":
            self._require_mpi_for_adasum(initialized=True)
        if self.sync == "hierarchical" and self.hierarchical_impl == "native":
            if not (hvd.mpi_enabled() and hvd.nccl_built() and on_gpu):
                raise ValueError(
                    "hierarchical_impl='native' needs the MPI controller, NCCL and GPUs; this job has "
                    f"mpi={hvd.mpi_enabled()}, nccl={bool(hvd.nccl_built())}, gpu={on_gpu}. "
                    "Use hierarchical_impl='process_sets', which works on every build."
                )
        super().setup_environment()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if not any(isinstance(callback, StrategyLoopHooks) for callback in trainer.callbacks):
            trainer.callbacks.append(StrategyLoopHooks(self))
        fitting = trainer.state.fn == TrainerFn.FITTING
        assert_ranks_agree(self._fingerprint(self.model, trainer))
        self.model = self.precision_plugin.convert_module(self.model)
        if self.sync_batchnorm or self._layer_sync is not None:
            self.model = convert_sync_batchnorm(self.model)
        self.model_to_device()
        attach_horovod_metric_sync(self.model)
        self._setup_topology()
        # Every worker starts from rank 0's weights and buffers (also after a checkpoint restore).
        horovod_torch().broadcast_parameters(self.model.state_dict(), root_rank=0)
        if fitting:
            self._backward_passes = max(1, int(trainer.accumulate_grad_batches))
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._setup_daso(trainer)

    def _fingerprint(self, model: Module, trainer: pl.Trainer) -> dict[str, Any]:
        """What must be equal on every rank, or collectives would deadlock."""
        return {
            "compression": self.compression,
            "op": self.op,
            "sync": self.sync,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "daso": None if self.daso_config is None else self.daso_config.as_dict(),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "parameters": [(name, tuple(p.shape)) for name, p in model.named_parameters()],
            "trainer_fn": str(trainer.state.fn),
        }

    def _setup_topology(self) -> None:
        if self.sync == "allreduce" or (self.sync == "hierarchical" and self.hierarchical_impl == "native"):
            return
        if self._groups is None:
            self.topology = discover_topology()
            self._groups = build_node_groups(self.topology)

    def _make_gradient_sync(self) -> GradientSync:
        compression = compressor_by_name(self.compression)
        hvd = horovod_torch()
        if self.sync == "hierarchical" and self.hierarchical_impl == "process_sets":
            assert self._groups is not None
            return HierarchicalGradientSync(
                self._groups,
                compression,
                self.op,
                self.comm_counters,
                compress_node_local=self.compress_node_local,
                bucket_bytes=self.bucket_bytes,
            )
        if self.sync == "daso":
            assert self._groups is not None
            # Inside the node every step; the cross-node parameter sync is DASO's job.
            if self._groups.local is None:
                return NoGradientSync()  # one worker per node: nobody to average with locally
            return HorovodOptimizerSync(
                compression, self.op, self.comm_counters, Scope.NODE_LOCAL, process_set=self._groups.local
            )
        scope = Scope.CROSS_NODE if hvd.cross_size() > 1 else Scope.NODE_LOCAL
        return HorovodOptimizerSync(
            compression,
            self.op,
            self.comm_counters,
            scope,
            gradient_predivide_factor=self.gradient_predivide_factor,
        )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        assert_ranks_agree(optimizer_fingerprint(self.optimizers))  # before any optimizer collective
        if self.scale_lr:
            self._scale_learning_rates(self.world_size)
        self._gradient_sync = self._make_gradient_sync()
        self._gradient_sync.backward_passes = self._backward_passes
        wrapped = []
        for index, optimizer in enumerate(self.optimizers):
            names = named_parameters_for(optimizer, self.lightning_module, prefix=f"opt{index}")
            wrapped.append(self._gradient_sync.wrap(optimizer, names))
        for config in self.lr_scheduler_configs:
            if config.scheduler.optimizer in self.optimizers:
                config.scheduler.optimizer = wrapped[self.optimizers.index(config.scheduler.optimizer)]
        self.optimizers = wrapped
        if self.check_finite_gradients:
            require_no_grad_scaler(self.precision_plugin)
            self._finite_check = FiniteGradientCheck(self.optimizers)

    def _scale_learning_rates(self, factor: int) -> None:
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * factor
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * factor
        for config in self.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    def _setup_daso(self, trainer: pl.Trainer) -> None:
        if self.sync != "daso":
            return
        from hvd_plugins.callbacks.daso import DasoScheduleCallback
        from hvd_plugins.daso.sync import DasoSync

        assert self._groups is not None and self.daso_config is not None and self.model is not None
        self.daso = DasoSync(
            self.daso_config,
            self._groups,
            self.comm_counters,
            total_epochs=trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None,
        )
        self.daso.setup(self.model, self.optimizers)
        if not any(isinstance(callback, DasoScheduleCallback) for callback in trainer.callbacks):
            trainer.callbacks.append(DasoScheduleCallback())

    # ------------------------------------------------------------------ stepping
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        sync = self._gradient_sync
        if sync is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_average() -> Any:
            result = closure()  # forward + backward of the micro-batch that steps
            with self._waiting("gradient allreduce"):
                sync.synchronize(optimizer)  # averaged before clipping and AMP unscaling see them
                if self._finite_check is not None:
                    self._finite_check.after_average(optimizer, self._progress_text())
            return result

        with sync.deferred(optimizer):
            output = super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        self._stepped_this_batch = True
        return output

    def on_train_epoch_start_hook(self, trainer: Trainer) -> None:
        """Follow accumulation schedules that change between epochs; refuse uneven node-aware runs."""
        if self.sync != "allreduce" and self.world_size > 1:
            self._require_even_batches(trainer)
        passes = trainer.accumulate_grad_batches
        if passes != self._backward_passes and self._gradient_sync is not None:
            self._backward_passes = passes
            for optimizer in self.optimizers:
                self._gradient_sync.set_backward_passes(optimizer, passes)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.accumulate_grad_batches != self._backward_passes:
            raise ValueError(
                f"accumulate_grad_batches changed to {trainer.accumulate_grad_batches} in the middle of epoch "
                f"{trainer.current_epoch} (was {self._backward_passes}). HorovodStrategy follows accumulation "
                "schedules that change at epoch starts (GradientAccumulationScheduler), not within an epoch."
            )
        self._stepped_this_batch = False
        super().on_train_batch_start(batch, batch_idx)

    def on_train_batch_end_hook(self, trainer: Trainer, batch_idx: int) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        last = (
            epoch_loop.batch_progress.is_last_batch
            or batch_idx + 1 >= trainer.num_training_batches
            or (trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps)
        )
        if self.daso is not None and self._stepped_this_batch:
            self.daso.after_optimizer_step(last_batch_of_epoch=last)
        if last:
            self._finish_training_epoch(trainer)

    def _finish_training_epoch(self, trainer: Trainer) -> None:
        """Runs on every rank after its own last training batch, before validation."""
        hvd = horovod_torch()
        if self.world_size == 1:
            return
        if self.sync == "allreduce":
            # Ranks that ran out of data wait here while the others finish their batches; their
            # gradients count as zeros meanwhile (Horovod's join), and nobody hangs.
            last_rank = hvd.join()
            COLLECTIVE_NAMES.resync()  # op counters may have drifted apart while ranks were uneven
            self._resync_after_uneven_epoch(trainer, last_rank)
        if self.average_buffers and self.model is not None and self.daso is None:
            average_buffers_(self.model, name="epoch_end_buffers")

    def _resync_after_uneven_epoch(self, trainer: Trainer, last_rank: int) -> None:
        """Joined ranks skipped the last updates: copy the state of the rank that ran longest."""
        steps = self.all_gather(torch.tensor([trainer.global_step], dtype=torch.int64))
        if bool((steps == steps[0]).all()) or self.model is None:
            return
        hvd = horovod_torch()
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=last_rank)
        for index, optimizer in enumerate(self.optimizers):
            broadcast_optimizer_state_(optimizer, root_rank=last_rank, name=COLLECTIVE_NAMES.next(f"opt{index}"))

    def _require_even_batches(self, trainer: Trainer) -> None:
        """Node-aware syncs cannot use Horovod's join: uneven ranks must be refused, not hung."""
        batches = trainer.num_training_batches
        known = -1 if batches == float("inf") else int(batches)
        counts = self.all_gather(torch.tensor([known], dtype=torch.int64)).flatten().tolist()
        if -1 not in counts and len(set(counts)) > 1:
            raise ValueError(
                f"sync={self.sync!r} needs the same number of training batches on every rank, but ranks have "
                f"{dict(enumerate(counts))}. Use Lightning's DistributedSampler (the default), drop_last=True, "
                "or sync='allreduce', which handles uneven data with Horovod's join."
            )

    # ------------------------------------------------------------------ checkpoints
    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        for index, optimizer in enumerate(self.optimizers):
            broadcast_optimizer_state_(optimizer, root_rank=0, name=f"opt{index}")

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.model is not None and horovod_torch().is_initialized():
            horovod_torch().broadcast_parameters(self.model.state_dict(), root_rank=0)

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if not isinstance(tensor, Tensor) or self.world_size == 1:
            return tensor
        if group is not None:
            raise ValueError(f"HorovodStrategy.reduce got group={group!r}; only the whole world (None) is supported")
        op_name = _reduce_op_name(reduce_op)
        hvd = horovod_torch()
        hvd_op = {"average": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}[op_name]
        original_dtype = tensor.dtype
        wire = tensor.detach()
        if wire.dtype in (torch.bfloat16, torch.bool) or (op_name == "average" and not wire.is_floating_point()):
            wire = wire.to(torch.float64 if not wire.is_floating_point() else torch.float32)
        result = hvd.allreduce(wire, op=hvd_op, name=COLLECTIVE_NAMES.next("reduce"))
        if op_name == "average" and not original_dtype.is_floating_point:
            return result
        return result.to(original_dtype)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from every worker along a new first dimension."""
        if group is not None:
            raise ValueError(
                f"HorovodStrategy.all_gather got group={group!r}; only the whole world (None) is supported"
            )
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        hvd = horovod_torch()
        original_dtype = tensor.dtype
        wire = tensor if sync_grads else tensor.detach()
        if wire.dtype in (torch.bfloat16, torch.bool):
            wire = wire.to(torch.float32)
        with torch.inference_mode(False):  # Horovod resizes the output on its own thread
            gathered = hvd.allgather(wire.clone().unsqueeze(0), name=COLLECTIVE_NAMES.next("all_gather"))
        return gathered.to(original_dtype)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if self.world_size == 1:
            return obj
        return horovod_torch().broadcast_object(obj, root_rank=src, name=COLLECTIVE_NAMES.next("broadcast"))

    @override
    def barrier(self, name: str | None = None) -> None:
        if self.world_size > 1 and horovod_torch().is_initialized():
            with self._waiting(f"barrier {name or ''}".strip()):
                horovod_torch().barrier()

    # ------------------------------------------------------------------ failures and teardown
    def _waiting(self, what: str) -> AbstractContextManager[None]:
        """Bound the wait with ``stall_timeout_seconds`` when it is set."""
        return self._watchdog.waiting(what) if self._watchdog is not None else nullcontext()

    def _progress_text(self) -> str:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return "setup"
        return f"epoch {trainer.current_epoch}, global step {trainer.global_step}"

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name this rank and what stopped it, so the launcher's output shows which rank failed first."""
        hvd = horovod_torch()
        if hvd.is_initialized():
            report_failure(exception, hvd.rank(), hvd.size(), hvd.local_rank(), self._progress_text())

    @override
    def teardown(self) -> None:
        if self._finite_check is not None:
            self._finite_check.remove()
            self._finite_check = None
        for optimizer in self.optimizers:
            # Drop Horovod's gradient hooks so a later fit in this process starts clean.
            getattr(optimizer, "_grad_accs", []).clear()
        self._gradient_sync = None
        self.daso = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        from hvd_plugins.registry import register_named_strategies

        register_named_strategies(strategy_registry)


def _reduce_op_name(reduce_op: ReduceOp | str | None) -> str:
    if reduce_op is None:
        return "average"
    if isinstance(reduce_op, str):
        key = reduce_op.lower()
    else:
        key = {"SUM": "sum", "AVG": "average", "MAX": "max", "MIN": "min"}.get(getattr(reduce_op, "name", ""), "")
    if key not in _REDUCE_OP_NAMES:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported; choose one of {sorted(_REDUCE_OP_NAMES)}")
    return _REDUCE_OP_NAMES[key]
