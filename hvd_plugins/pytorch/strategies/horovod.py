"""HorovodStrategy: the one place that talks to Lightning's Trainer.

It wires the core (``hvd_plugins.core``: Horovod start-up, the gradient syncs, the epoch-end policy,
fault handling) into Lightning's hooks; it implements none of them, and it never asks which sync
mode runs: every mode offers the same hooks. Launch with ``horovodrun -np N python train.py``, or run
``python train.py``: with ``devices=N`` it starts its N workers itself, with one device it is one process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from hvd_plugins.core.backend import capabilities
from hvd_plugins.core.backend import optimizer as horovod_optimizer
from hvd_plugins.core.backend.agreement import assert_ranks_agree
from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.core.backend.startup import init_horovod
from hvd_plugins.core.comm.counters import CommCounters
from hvd_plugins.core.compiled_graphs import GraphCuts
from hvd_plugins.core.config import (
    DEFAULT_COMMIT_EVERY_N_STEPS,
    CompressionName,
    CpuThreads,
    Elastic,
    GradientOp,
    HierarchicalImpl,
    HorovodConfig,
    Megabytes,
    ParamDtypeArgument,
    Shard,
    ShardCheckpoint,
    StallTimeout,
    StateDictType,
    SyncMode,
    UnitPolicy,
)
from hvd_plugins.core.elastic.launch import runs_elastic
from hvd_plugins.core.epoch_end import EpochEndPolicy
from hvd_plugins.core.faults.fingerprints import job_fingerprint, optimizer_fingerprint
from hvd_plugins.core.faults.preemption import slurm_job_id
from hvd_plugins.core.faults.report import report_failure
from hvd_plugins.core.metrics_sync import attach_horovod_metric_sync
from hvd_plugins.core.recompute import checkpoint_activations
from hvd_plugins.core.sync.base import GradientSync
from hvd_plugins.core.sync.daso.config import DasoConfig
from hvd_plugins.core.sync.guards import SyncGuards
from hvd_plugins.core.training_state import scale_learning_rates_, wrap_optimizers
from hvd_plugins.fabric.lightning_internals import (
    CheckpointPath,
    checkpoint_content,
    layer_sync,
    lightning_optimizers,
    module_trainer,
    names_the_commit,
    optimizers_to_device,
    set_launcher,
    set_layer_sync,
)
from hvd_plugins.fabric.plugins.environments.horovod import HorovodEnvironment
from hvd_plugins.fabric.strategies.shared import HorovodStrategyShared
from hvd_plugins.pytorch.callbacks.progress import progress_bar_given_to_trainer, use_line_progress_bar
from hvd_plugins.pytorch.elastic import ElasticCommitCallback, ElasticFit
from hvd_plugins.pytorch.loop_events import TrainingLoopEvents, training_position
from hvd_plugins.pytorch.plugins.clipping import clip_through_sync
from hvd_plugins.pytorch.plugins.layer_sync import horovod_layer_sync
from hvd_plugins.pytorch.preemption import RequeueOnPreemption
from hvd_plugins.pytorch.resume_position import ResumePosition
from hvd_plugins.pytorch.strategies.launchers.elastic import HorovodElasticLauncher
from hvd_plugins.pytorch.strategies.launchers.horovod import HorovodScriptLauncher
from hvd_plugins.pytorch.strategies.unit_init import UnitInit
from hvd_plugins.pytorch.utilities.namespace import describe_strategy, require_own_namespace
from hvd_plugins.pytorch.utilities.rank_zero import follow_rank

if TYPE_CHECKING:
    import lightning.pytorch as pl


class HorovodStrategy(HorovodStrategyShared, UnitInit):
    """Data-parallel training over Horovod (Gloo or MPI controller; NCCL on GPUs). The arguments become
    ``self.config``, a frozen ``HorovodConfig`` (same names, more detail), validated at once.

    Args:
        compression: ``"none"``, ``"fp16"`` or ``"bf16"``: gradients on the wire (DASO's: ``DasoConfig.downcast``).
        op: ``"average"``, ``"sum"`` or ``"adasum"`` (MPI builds only).
        gradient_predivide_factor: divide before the sum, the rest after (``op="average"``, flat sync).
        sparse_as_dense: send sparse gradients (``nn.Embedding(sparse=True)``) dense: one allreduce, not two allgathers.
        scale_lr: multiply learning rates (and schedulers' base lrs) by the number of workers.
        sync: ``"allreduce"`` (flat), ``"hierarchical"`` (node, then across nodes) or ``"daso"``.
        shard: ``"none"``; ``"optimizer"`` (ZeRO-1), ``"gradients"`` (ZeRO-2), ``"parameters"`` (ZeRO-3) split those.
        shard_checkpoint, state_dict_type, async_save: ``"full"``, ``"dcp"`` (``"sharded"``), ``"parts"``; DCP async?
        auto_wrap_policy, reshard_after_forward: ``shard="parameters"``'s units (module classes), freed after forward?
        param_dtype: the dtype ``shard="parameters"`` gathers units in: ``"auto"`` (bf16-mixed on GPUs: bf16), "full".
        activation_checkpointing_policy: modules (classes) whose activations backward recomputes instead of keeping.
        hierarchical_impl, compress_node_local: ``"portable"`` (every build) or ``"native"`` (MPI + NCCL only);
            with ``sync="hierarchical"``, compress the node-local legs too.
        daso: a ``DasoConfig`` or a dict of its fields; only with ``sync="daso"``.
        average_buffers: average floating buffers over all workers at every training epoch's end.
        bucket_mb: gradient bucket size of the node-aware syncs, in MiB.
        flat_below_mb: with ``sync="hierarchical"``, buckets under this many MiB take one flat allreduce. ``"auto"``:
            1 MiB, and larger buckets time both routes on the first 11 steps and keep the faster (rank 0 logs it).
        stall_timeout_seconds: a worker waiting this long in a gradient allreduce or barrier ends the job (exit
            75). ``"auto"``: horovodrun's ``--stall-check-shutdown-time-seconds``, else 1800; ``None``: no bound.
        check_finite_gradients: stop every rank at the first NaN/Inf gradient (one small allreduce per step).
        auto_requeue: in a Slurm job, save, requeue and stop at SIGUSR1 or SIGTERM (``RequeueOnPreemption``).
        cpu_threads: torch's threads per worker; ``"auto"``: the host's cores shared among its workers.
        elastic: go on in place when workers die or join; ``"auto"``: when horovodrun started so (docs/elastic.rst).
        commit_every_n_steps: in an elastic job, commit the training state to host memory this often (steps).
        accelerator, parallel_devices, precision_plugin: Lightning's; the Trainer sets them from its own arguments.
        checkpoint_io: how checkpoints are written; ``None``: ``AtomicCheckpointIO`` (temporary file, fsync, rename).

    Synchronized BatchNorm: ``Trainer(sync_batchnorm=True)`` (or ``plugins=[HorovodSyncBatchNorm()]``). State for
    callbacks: ``config``, ``comm_counters``, ``gradient_sync``, ``topology``, ``daso_sync``, ``route_tuner``."""

    strategy_name = "horovod"

    def __init__(
        self,
        compression: CompressionName = "none",
        op: GradientOp = "average",
        gradient_predivide_factor: float = 1.0,
        sparse_as_dense: bool = False,
        scale_lr: bool = False,
        sync: SyncMode = "allreduce",
        shard: Shard = "none",
        shard_checkpoint: ShardCheckpoint = "full",
        state_dict_type: StateDictType | None = None,
        async_save: bool = False,
        auto_wrap_policy: UnitPolicy = None,
        reshard_after_forward: bool = True,
        param_dtype: ParamDtypeArgument = "auto",
        activation_checkpointing_policy: UnitPolicy = None,
        hierarchical_impl: HierarchicalImpl = "portable",
        compress_node_local: bool = False,
        daso: DasoConfig | dict[str, Any] | None = None,
        average_buffers: bool = True,
        bucket_mb: float = 32.0,
        flat_below_mb: Megabytes = "auto",
        stall_timeout_seconds: StallTimeout = "auto",
        check_finite_gradients: bool = False,
        auto_requeue: bool = True,
        cpu_threads: CpuThreads = "auto",
        elastic: Elastic = "auto",
        commit_every_n_steps: int = DEFAULT_COMMIT_EVERY_N_STEPS,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name in HorovodConfig.argument_names()}
        self._environment = HorovodEnvironment()
        super().__init__(accelerator, parallel_devices, self._environment, checkpoint_io, precision_plugin)
        self.config = HorovodConfig.build(**arguments)  # every config field is an argument of the same name
        capabilities.require_build_supports(self.config)
        self.num_nodes = 1  # set by the Trainer; checked against the launch in setup_environment
        self.comm_counters = CommCounters()
        self.gradient_sync: GradientSync | None = None  # built at the first setup, kept across fits
        self._guards = SyncGuards(self.config)
        self._graph_cuts = GraphCuts(self.config.bucket_bytes)  # a compiled model's graphs end at gradient buckets
        self._restored_sync_state: dict[str, Any] = {}  # for the next sync built: from a checkpoint or a reset
        self._progress_bar_given: bool | None = None
        self._resume_position = ResumePosition()  # a mid-epoch resume continues at the next batch
        self.elastic = ElasticFit(self.config.commit_every_n_steps) if runs_elastic(self.config) else None
        """With an elastic launch: the commits and resets of this strategy's fits (``elastic.resets`` counts)."""

    def __repr__(self) -> str:  # named with its Lightning package: Lightning prints it refusing the other package's
        return describe_strategy(self)

    @property
    @override
    def optimizers(self) -> list[Optimizer]:
        return super().optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]  # the base's setter
        horovod_optimizer.pin_zero_grad(lightning_optimizers(self))

    # ------------------------------------------------------------------ ranks and devices
    @property
    def is_distributed(self) -> bool:
        """Lightning asks this to add a DistributedSampler and to honour ``sync_dist`` (elastic: at any size)."""
        return self.world_size > 1 or self.elastic is not None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """When the Trainer is built: start Horovod (unless this process launches the workers) for rank-zero output."""
        self._plan_launch()
        self._follow_rank(self.global_rank)
        self._progress_bar_given = progress_bar_given_to_trainer()  # before Lightning adds its default bar

    @override
    def _configure_launcher(self) -> None:
        size = self._environment.launch_size
        if self.elastic is not None:  # horovodrun started the workers; the launcher runs fits elastically
            set_launcher(self, HorovodElasticLauncher(self.elastic, self.forget_world))
        else:
            set_launcher(self, HorovodScriptLauncher(size, partial(init_horovod, self.config)) if size else None)

    @override
    def setup_environment(self) -> None:
        self._start_worker()
        if self.lightning_module is not None:  # before callbacks' setup, so a swapped-in bar is set up too
            require_own_namespace(self.lightning_module.trainer)
            use_line_progress_bar(self.lightning_module.trainer, self._progress_bar_given, self.world_size)
        super().setup_environment()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        config = self.config.fingerprint()
        assert_ranks_agree(job_fingerprint(config, self.model, trainer.accumulate_grad_batches, str(trainer.state.fn)))
        self.model = self.precision_plugin.convert_module(self.model)
        set_layer_sync(self, horovod_layer_sync(layer_sync(self), self.config.sync))
        if fitting and (sync_layers := layer_sync(self)) is not None:  # as DDP: while fitting, reverted at teardown
            self.model = sync_layers.apply(self.model)
        checkpoint_activations(self.model, self.config.activation_checkpointing_policy)
        self._placement.prepare(self.model, self.root_device)
        self._graph_cuts.open()  # until teardown: graphs torch.compile captures meanwhile end at gradient buckets
        attach_horovod_metric_sync(self.model)
        if self.gradient_sync is None:
            self.gradient_sync = self._build_gradient_sync(self.precision_plugin)  # a collective
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        clip_through_sync(self.precision_plugin, lambda: self.gradient_sync)
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)
            max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
            self.gradient_sync.setup(self.model, self.optimizers, total_epochs=max_epochs)
            TrainingLoopEvents.install(
                trainer, EpochEndPolicy(self.config, self.all_gather), self.gradient_sync, self.reduce
            )
            RequeueOnPreemption.install(trainer, slurm_job_id() if self.config.auto_requeue else None)
            if self.elastic is not None:
                ElasticCommitCallback.install(trainer, self.elastic, self.checkpoint_content)  # after the loop events
        else:  # validate, test, predict: sharded too under shard="parameters"
            sync, model = self.gradient_sync, self.model
            self._placement.set_up_alone(lambda: sync.setup(model, [], total_epochs=None))

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None and self.gradient_sync is not None
        assert_ranks_agree(optimizer_fingerprint(self.optimizers))  # before any optimizer collective
        if self.config.scale_lr:
            scale_learning_rates_(self.optimizers, [c.scheduler for c in self.lr_scheduler_configs], self.world_size)
        self.gradient_sync.refuse_unsupported(trainer.accumulate_grad_batches, bool(trainer.gradient_clip_val))
        self.gradient_sync.refuse_grad_scaler(getattr(self.precision_plugin, "scaler", None))
        self.gradient_sync.backward_passes = max(1, int(trainer.accumulate_grad_batches))
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        self.optimizers = wrap_optimizers(self.gradient_sync, self.optimizers, self.lightning_module, schedulers)
        self._guards.check_gradients_of(self.optimizers, self.precision_plugin)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Settle what an earlier backward of the step started; a manual backward's gradients are averaged at once."""
        self._settle_earlier_backward(self.optimizers)
        result = super().backward(closure_loss, optimizer, *args, **kwargs)
        average_manual_backward(self)
        return result

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        sync = self.gradient_sync
        if sync is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_average() -> Any:
            result = closure()  # forward + backward of the micro-batch that steps
            self._guards.average_for_step(sync, optimizer, lambda: training_position(self._trainer))
            return result

        with sync.deferred(optimizer):
            return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: CheckpointPath, storage_options: Any | None = None
    ) -> None:
        self._add_sync_state(checkpoint)
        self._resume_position.record(self._trainer, checkpoint)
        if not self._write_trainer_dcp(checkpoint, filepath):
            self._write_optimizer_parts(checkpoint, filepath)
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def checkpoint_content(self, trainer: pl.Trainer) -> dict[str, Any]:
        """What an elastic commit keeps: a checkpoint's content now, as the sync mode commits it (sharded: parts)."""
        with self._committing():
            checkpoint = checkpoint_content(trainer)
        self._add_sync_state(checkpoint)
        return checkpoint

    @override
    def _follow_rank(self, rank: int) -> None:
        follow_rank(rank)  # rank-zero output, and Python's warnings on rank 0 only

    @override
    def _synced_optimizers(self) -> Sequence[Optimizer]:
        return self.optimizers

    @override
    def load_checkpoint(self, checkpoint_path: CheckpointPath, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Hand the gradient sync its state; Lightning restores checkpoints before ``setup`` builds the sync. In an
        elastic fit, after a reset, the path names the last commit, in host memory (a directory: ``dcp_read``)."""
        if self.elastic is not None and names_the_commit(checkpoint_path):
            checkpoint = self.elastic.restore(self._trainer, scale_lr=self.config.scale_lr)
        else:
            read_file = partial(super().load_checkpoint, checkpoint_path, *args, **kwargs)
            checkpoint = self._read_checkpoint(checkpoint_path, read_file)
        self._take_sync_state(checkpoint)
        self._resume_position.restore(self._trainer, checkpoint)
        return checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._saved_model_state(self.lightning_module)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._load_model_state(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return self._saved_optimizer_state(inner, self.lightning_module)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._load_optimizer_states(self.optimizers, checkpoint["optimizer_states"], self.lightning_module or Module())

    @override
    def process_dataloader(self, dataloader: object) -> object:
        position = self._resume_position if self.elastic is None else self.elastic  # where the epoch goes on
        return position.prepare(self._trainer, dataloader)

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return self._reduce_over_workers("reduce", tensor, group, reduce_op)

    # ------------------------------------------------------------------ failures and teardown
    @property
    def _trainer(self) -> pl.Trainer | None:
        return module_trainer(self.lightning_module)  # None before setup

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name this rank and what stopped it, so the launcher's output shows which rank failed first."""
        hvd = horovod_torch()
        if hvd.is_initialized():
            report_failure(exception, hvd.rank(), hvd.size(), hvd.local_rank(), training_position(self._trainer))

    @override
    def teardown(self) -> None:
        self._stop_watching()
        if self.gradient_sync is not None:
            self.gradient_sync.teardown(self.optimizers)  # its state (the measured route) stays for a later fit
        trainer = self._trainer
        sync_layers = layer_sync(self)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and sync_layers and self.model:
            self.model = sync_layers.revert(self.model)
        super().teardown()


def average_manual_backward(strategy: HorovodStrategy) -> None:
    """Manual optimization (several ``manual_backward`` calls before ``step``, as DDP allows): a backward's gradients
    averaged as it ends, as DDP's backward leaves them, so torch's own clipping between ``manual_backward`` and
    ``step`` reads the average (under ``shard="parameters"``: the parameters' gradient shards)."""
    module = strategy.lightning_module
    if module is not None and not module.automatic_optimization:
        where = partial(training_position, module_trainer(module))
        strategy.average_as_backward_ends(strategy.optimizers, where=where)
