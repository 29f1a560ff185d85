"""HorovodStrategy's settings as one frozen, validated value.

The strategy keeps its keyword arguments as the public face and builds this config from them,
so validation, the rules between arguments and what every rank must agree on live in one place.
Nothing here imports Horovod or Lightning: a bad argument is refused before any process starts
a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, Union, get_args

from hvd_plugins.core.backend.stall import DEFAULT_STALL_TIMEOUT_SECONDS, validate_stall_timeout
from hvd_plugins.core.comm.compression import compressor_by_name
from hvd_plugins.core.cpu_threads import validate_cpu_threads
from hvd_plugins.core.sync.daso.config import DasoConfig

if TYPE_CHECKING:
    import torch

CompressionName = Literal["none", "fp16", "bf16"]
"""How gradients travel: ``"none"`` (their own dtype), ``"fp16"`` or ``"bf16"`` (float16 or bfloat16 on the wire)."""
GradientOp = Literal["average", "sum", "adasum"]
"""How gradients combine across workers (``"adasum"`` needs Horovod's MPI controller)."""
SyncMode = Literal["allreduce", "hierarchical", "daso"]
"""``allreduce``: flat; ``hierarchical``: inside the node, then across nodes; ``daso``: see DasoConfig."""
Shard = Literal["none", "optimizer", "gradients", "parameters"]
"""``none``: every worker holds everything; ``optimizer``: the optimizer state is split over the workers
(ZeRO-1); ``gradients``: the optimizer state and the averaged gradients are (ZeRO-2); ``parameters``: and the
parameters of the model's units too, each gathered whole only while it computes (ZeRO-3)."""
UnitPolicy = Collection[type] | Callable[[Any], bool] | None
"""Which modules are units of ``shard="parameters"``: module classes (as Lightning's ``FSDPStrategy`` takes
them), a function of a module, or None for the model's repeated blocks (the members of a ``ModuleList`` or
``Sequential`` of one class, or the classes of Hugging Face's ``_no_split_modules``); what no unit holds is the
model's own unit, whole for the whole forward and backward."""
ShardCheckpoint = Literal["full", "parts", "dcp"]
StateDictType = Literal["full", "sharded"]
"""``full``: a checkpoint holds the whole optimizer state, by rank 0; ``parts``: every worker writes its part."""
ParamDtype = Literal["auto", "full", "bf16", "fp16"]
PARAM_DTYPES: tuple[str, ...] = get_args(ParamDtype)
"""``param_dtype``: the dtype ``shard="parameters"`` gathers units in to compute. ``"auto"``: on GPUs ``"bf16"`` under
``precision="bf16-mixed"`` (``"fp16"`` under ``"16-mixed"``), else ``"full"``, the parameters' own. A torch dtype
(``torch.bfloat16``, ``torch.float16``, ``torch.float32``) or None (the parameters' own) is taken too."""
ParamDtypeArgument = Union[ParamDtype, "torch.dtype", None]  # a string: torch is not imported here
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "full", "None": "full"}
HierarchicalImpl = Literal["portable", "native"]
"""``portable``: this package's two-level allreduce, on every build; ``native``: Horovod's (MPI + NCCL)."""
Megabytes = float | Literal["auto"]
StallTimeout = float | Literal["auto"] | None
CpuThreads = int | Literal["auto"] | None
Elastic = bool | Literal["auto"]
"""``"auto"``: elastic exactly when horovodrun started an elastic job (``--host-discovery-script``)."""

COMPRESSIONS: tuple[str, ...] = get_args(CompressionName)
GRADIENT_OPS: tuple[str, ...] = get_args(GradientOp)
SYNC_MODES: tuple[str, ...] = get_args(SyncMode)
SHARDS: tuple[str, ...] = get_args(Shard)
SHARD_CHECKPOINTS: tuple[str, ...] = get_args(ShardCheckpoint)
STATE_DICT_TYPES: dict[str, str] = {"full": "full", "sharded": "dcp"}
"""``state_dict_type`` (Lightning's ``FSDPStrategy`` name) -> the ``shard_checkpoint`` it means."""
HIERARCHICAL_IMPLS: tuple[str, ...] = get_args(HierarchicalImpl)

DEFAULT_COMMIT_EVERY_N_STEPS = 50
"""Elastic commits: at most this many steps are trained again after a worker dies (docs/elastic.rst has
what a commit costs; the default keeps it under 3 % of a step's time on the benchmarks' large MLP)."""

FLAT_BELOW_MB = 1.0
"""Default size (MiB) under which a hierarchical bucket is summed by one flat allreduce.

A two-level allreduce takes three collective rounds where a flat one takes one; below this size
the rounds, not the bytes, decide. What the two extra rounds buy is cross-node bytes: each worker
sends a share of a bucket across instead of all of it. Where that pays depends on the link, which
is why the default, ``flat_below_mb="auto"``, times both routes for the larger buckets
(``comm.route_tuning``); the measurements behind this size are in docs/measurements.rst.
"""


def validate_commit_interval(steps: object) -> None:
    """``commit_every_n_steps`` must be a whole number of steps, at least one."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"commit_every_n_steps={steps!r} must be a whole number >= 1")


def _choice(argument: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{argument}={value!r} is not supported; choose one of {list(allowed)}")
    return value


@dataclass(frozen=True)
class HorovodConfig:
    """What HorovodStrategy was asked to do; see HorovodStrategy for each argument's meaning."""

    compression: CompressionName = "none"
    """Name of the gradient wire format, ``"none"``, ``"fp16"`` or ``"bf16"``."""
    op: GradientOp = "average"
    """How gradients combine across workers, ``"average"``, ``"sum"`` or ``"adasum"``."""
    gradient_predivide_factor: float = 1.0
    """Divide gradients by this before the sum and by ``size / factor`` after (average only)."""
    sparse_as_dense: bool = False
    """Send sparse gradients as dense tensors (flat sync; the node-aware syncs always send them dense)."""
    scale_lr: bool = False
    """Multiply learning rates by the number of workers (never done silently)."""
    sync: SyncMode = "allreduce"
    """One of SYNC_MODES."""
    shard: Shard = "none"
    """One of SHARDS: what is split over the workers instead of held whole by each (docs/sharding.rst)."""
    shard_checkpoint: ShardCheckpoint = "full"
    """Checkpoints whole, written by rank 0 (``"full"``); in torch's distributed checkpoint format, every worker
    writing its own shards (``"dcp"``); or, with ``shard``, with every worker's optimizer part beside (``"parts"``)."""
    auto_wrap_policy: UnitPolicy = None
    """With ``shard="parameters"``: which modules are units (see UnitPolicy); classes are kept as a frozenset."""
    state_dict_type: StateDictType | None = None
    """``FSDPStrategy``'s name for ``shard_checkpoint``: ``"full"`` is ``"full"``, ``"sharded"`` is ``"dcp"``."""
    async_save: bool = False
    """With DCP checkpoints: a save returns once each worker has copied its shards into host memory, and a thread
    writes them while training goes on (torchtitan's ``async_mode``; the next save waits for it)."""
    activation_checkpointing_policy: UnitPolicy = None
    """Modules (classes, or a function of a module) whose activations are recomputed in backward instead of kept."""
    reshard_after_forward: bool = True
    """With ``shard="parameters"``: free a unit's gathered parameters after its forward (gather again for its
    backward); False keeps them from forward to backward: fewer gathers, more memory."""
    param_dtype: ParamDtype = "auto"
    """With ``shard="parameters"``: the dtype units are gathered in to compute (see PARAM_DTYPES); the slices the
    optimizer steps stay in the parameters' own dtype."""
    hierarchical_impl: HierarchicalImpl = "portable"
    """``"portable"`` (every build) or ``"native"`` (Horovod's own, with the MPI controller and NCCL)."""
    compress_node_local: bool = False
    """With ``sync="hierarchical"``, compress the node-local legs as well as the cross-node one."""
    daso: DasoConfig | None = None
    """DASO settings; set (to defaults when not given) exactly when ``sync="daso"``."""
    average_buffers: bool = True
    """Average floating buffers over all workers at the end of every training epoch."""
    bucket_mb: float = 32.0
    """Gradient bucket size of the hierarchical allreduce, in MiB."""
    flat_below_mb: Megabytes = "auto"
    """With ``sync="hierarchical"``, buckets smaller than this (MiB) take one flat allreduce; see FLAT_BELOW_MB.
    ``"auto"``: FLAT_BELOW_MB, and larger buckets time both routes on the first steps and keep the faster."""
    stall_timeout_seconds: int | None = DEFAULT_STALL_TIMEOUT_SECONDS
    """Longest wait in one collective before the worker ends the job; None waits forever."""
    check_finite_gradients: bool = False
    """Stop every rank at the first step whose gradients hold NaN/Inf."""
    auto_requeue: bool = True
    """Inside a Slurm job, at SIGUSR1 (``--signal=USR1@T``) or SIGTERM, save ``hpc_ckpt_<n>.ckpt``, requeue, stop."""
    cpu_threads: CpuThreads = "auto"
    """torch's intra-op threads per worker. ``"auto"`` shares the host's cores among its workers unless
    ``OMP_NUM_THREADS`` is set, a number sets it, None leaves torch's default (see ``cpu_threads``)."""

    elastic: Elastic = "auto"
    """Survive workers that die or join (``horovodrun --host-discovery-script``); see docs/elastic.rst."""
    commit_every_n_steps: int = DEFAULT_COMMIT_EVERY_N_STEPS
    """In an elastic job, commit the training state to host memory every this many optimizer steps."""

    def __post_init__(self) -> None:
        booleans = ("scale_lr", "compress_node_local", "average_buffers", "check_finite_gradients", "auto_requeue")
        for name in (*booleans, "reshard_after_forward", "async_save"):
            value = getattr(self, name)
            if not isinstance(value, bool) and value not in (0, 1):
                raise ValueError(f"{name}={value!r} must be True or False")
            object.__setattr__(self, name, bool(value))
        compressor_by_name(self.compression)  # raises naming the choices
        _choice("op", self.op, GRADIENT_OPS)
        _choice("sync", self.sync, SYNC_MODES)
        _choice("shard", self.shard, SHARDS)
        _choice("shard_checkpoint", self.shard_checkpoint, SHARD_CHECKPOINTS)
        if self.state_dict_type is not None:
            self._take_state_dict_type()
        if self.async_save and self.shard_checkpoint != "dcp":
            raise ValueError(
                f"async_save=True writes sharded checkpoints in the background, but checkpoints here are "
                f"{self.shard_checkpoint!r}: give state_dict_type='sharded' with it"
            )
        if self.shard_checkpoint == "parts" and self.shard == "none":
            raise ValueError(
                f"shard_checkpoint={self.shard_checkpoint!r} works only with shard='optimizer', 'gradients' or "
                "'parameters', not shard='none', whose workers each hold the whole state"
            )
        _choice("hierarchical_impl", self.hierarchical_impl, HIERARCHICAL_IMPLS)
        if not self.gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor={self.gradient_predivide_factor!r} must be a positive number")
        if self.gradient_predivide_factor != 1.0 and self.op != "average":
            raise ValueError(
                f"gradient_predivide_factor={self.gradient_predivide_factor!r} works only with op='average', "
                f"not op={self.op!r}"
            )
        if self.gradient_predivide_factor != 1.0 and self.sync != "allreduce":
            raise ValueError(
                f"gradient_predivide_factor={self.gradient_predivide_factor!r} works only with sync='allreduce', "
                f"not sync={self.sync!r}, whose collectives do not pre-divide"
            )
        if self.op == "sum" and self.sync == "daso":
            raise ValueError(
                "op='sum' does not work with sync='daso': warmup and cooldown sum gradients over all workers but "
                "cycling only inside the node, so the update's scale would change between phases; use op='average'"
            )
        if self.op == "adasum" and self.sync != "allreduce":
            raise ValueError(f"op='adasum' works only with sync='allreduce', not sync={self.sync!r}")
        if self.compress_node_local and self.sync != "hierarchical":
            raise ValueError(f"compress_node_local=True works only with sync='hierarchical', not sync={self.sync!r}")
        if self.hierarchical_impl != "portable" and self.sync != "hierarchical":
            raise ValueError(
                f"hierarchical_impl={self.hierarchical_impl!r} works only with sync='hierarchical', "
                f"not sync={self.sync!r}"
            )
        if self.shard != "none":
            self._check_shard()
        object.__setattr__(self, "auto_wrap_policy", unit_policy(self.auto_wrap_policy))
        policy = unit_policy(self.activation_checkpointing_policy, "activation_checkpointing_policy")
        object.__setattr__(self, "activation_checkpointing_policy", policy)
        if self.shard != "parameters" and self.auto_wrap_policy is not None:
            raise ValueError(
                f"auto_wrap_policy={{{describe_policy(self.auto_wrap_policy)}}} works only with shard='parameters', "
                f"not shard={self.shard!r}"
            )
        self._take_param_dtype()
        if self.shard != "parameters" and not self.reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward=False works only with shard='parameters', not shard={self.shard!r}"
            )
        if self.daso is not None and self.sync != "daso":
            raise ValueError(f"daso={self.daso!r} was given but sync={self.sync!r}; DASO settings need sync='daso'")
        if self.sync == "daso" and self.daso is None:
            object.__setattr__(self, "daso", DasoConfig())
        if self.flat_below_mb != "auto" and (
            isinstance(self.flat_below_mb, (str, bool)) or not self.flat_below_mb >= 0
        ):
            raise ValueError(f"flat_below_mb={self.flat_below_mb!r} must be 'auto' or a number of megabytes >= 0")
        if self.flat_below_mb != "auto" and self.sync != "hierarchical":
            raise ValueError(
                f"flat_below_mb={self.flat_below_mb!r} works only with sync='hierarchical', not sync={self.sync!r}"
            )
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb={self.bucket_mb!r} must be a positive number of megabytes")
        if self.stall_timeout_seconds is not None and (
            isinstance(self.stall_timeout_seconds, bool) or not isinstance(self.stall_timeout_seconds, int)
        ):
            raise ValueError(f"stall_timeout_seconds={self.stall_timeout_seconds!r} must be whole seconds or None")
        validate_cpu_threads(self.cpu_threads)
        if self.elastic not in (True, False, "auto"):
            raise ValueError(f"elastic={self.elastic!r} must be True, False or 'auto'")
        validate_commit_interval(self.commit_every_n_steps)

    def _take_state_dict_type(self) -> None:
        """``state_dict_type`` ("full" or "sharded") given: it sets ``shard_checkpoint``, which must agree."""
        chosen = STATE_DICT_TYPES.get(str(self.state_dict_type))
        if chosen is None:
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r} is not supported; choose one of {list(STATE_DICT_TYPES)}"
            )
        if self.shard_checkpoint not in ("full", chosen):
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r} and shard_checkpoint={self.shard_checkpoint!r} disagree: "
                f"give one of them (state_dict_type={self.state_dict_type!r} is shard_checkpoint={chosen!r})"
            )
        object.__setattr__(self, "shard_checkpoint", chosen)

    def _check_shard(self) -> None:
        """What sharding cannot do yet, refused before any process starts a collective."""
        if self.sync == "daso":
            raise ValueError(
                f"shard={self.shard!r} does not work with sync='daso': between its global syncs every node trains "
                "its own parameters and DASO averages them, whole, across nodes, non-blocking, while the next steps "
                "change them; a node-local shard would have to be gathered for that. For node-aware sharding use "
                "sync='hierarchical' with shard= (each node holds the state, split over its workers)."
            )
        if self.sync == "hierarchical" and self.flat_below_mb != "auto":
            raise ValueError(
                f"flat_below_mb={self.flat_below_mb!r} does not apply with shard={self.shard!r}: a bucket sharded "
                "inside the node always takes the node's reduce-scatter and the cross-node sum of its shard"
            )
        if self.sync == "hierarchical" and self.hierarchical_impl != "portable":
            raise ValueError(
                f"shard={self.shard!r} with sync='hierarchical' needs hierarchical_impl='portable' (the default), not "
                f"{self.hierarchical_impl!r}: Horovod's own hierarchical allreduce has no reduce-scatter to shard with"
            )
        if self.op == "adasum":
            raise ValueError(
                f"shard={self.shard!r} does not work with op='adasum': Adasum combines whole updates inside Horovod's "
                "optimizer; use op='average' or op='sum'"
            )
        if self.gradient_predivide_factor != 1.0:
            raise ValueError(
                f"gradient_predivide_factor={self.gradient_predivide_factor!r} does not work with shard={self.shard!r};"
                " its sums do not pre-divide"
            )
        if self.sparse_as_dense:
            raise ValueError(f"sparse_as_dense=True does not work with shard={self.shard!r}: it has no sparse path")

    def _take_param_dtype(self) -> None:
        """``param_dtype`` as one of PARAM_DTYPES (a torch dtype or None by its name), and only where units exist."""
        value = DTYPE_NAMES.get(str(self.param_dtype), self.param_dtype) if self.param_dtype != "auto" else "auto"
        if value not in PARAM_DTYPES:
            raise ValueError(
                f"param_dtype={self.param_dtype!r} is not supported; choose one of {list(PARAM_DTYPES)}, "
                "torch.bfloat16, torch.float16, torch.float32 or None"
            )
        if value not in ("auto", "full") and self.shard != "parameters":
            raise ValueError(
                f"param_dtype={self.param_dtype!r} works only with shard='parameters', not shard={self.shard!r}: "
                "only units are gathered"
            )
        object.__setattr__(self, "param_dtype", value)

    def gather_dtype(self, precision: str | None, on_gpu: bool) -> str:
        """The dtype ``shard="parameters"`` gathers units in under Lightning's ``precision``: ``"full"`` (the
        parameters' own), ``"bf16"`` or ``"fp16"``. ``"auto"`` halves only on GPUs: on the CPU autocast runs
        normalization layers in float32 without casting their weights, and torch refuses half weights there."""
        if self.param_dtype != "auto":
            return self.param_dtype
        return {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(str(precision), "full") if on_gpu else "full"

    @staticmethod
    def argument_names() -> tuple[str, ...]:
        """The strategy arguments this config holds: one per field."""
        return tuple(field.name for field in fields(HorovodConfig))

    @staticmethod
    def build(
        daso: DasoConfig | dict[str, Any] | None = None,
        stall_timeout_seconds: StallTimeout = "auto",
        **settings: Any,
    ) -> HorovodConfig:
        """Build from the strategy's keyword arguments: a dict of DASO fields, seconds as any number or "auto"."""
        return HorovodConfig(
            daso=None if daso is None else DasoConfig.from_any(daso),
            stall_timeout_seconds=validate_stall_timeout(stall_timeout_seconds),
            **settings,
        )

    @property
    def node_aware(self) -> bool:
        """Whether the sync needs to know which workers share a node (this package's node-aware collectives)."""
        return self.sync == "daso" or (self.sync == "hierarchical" and self.hierarchical_impl == "portable")

    @property
    def joins_uneven_data(self) -> bool:
        """Whether a rank that runs out of data may wait in Horovod's join (flat allreduce only: the node-aware
        and sharded syncs run collectives a joined rank cannot take part in)."""
        return self.sync == "allreduce" and self.shard == "none"

    @property
    def native_hierarchical(self) -> bool:
        return self.sync == "hierarchical" and self.hierarchical_impl == "native"

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @property
    def shards_parameters(self) -> bool:
        """``shard="parameters"``: a model may be built on the meta device and made real one unit at a time."""
        return self.shard == "parameters"

    @property
    def averages_after_backward(self) -> bool:
        """Whether a backward outside a loop's accumulation averages its gradients as it ends (as DDP's leaves
        them), for torch's own clipping before the step: with the flat sync and ``op="average"``. An average of
        averaged gradients plus new ones is the average of both, so a loop that accumulates without
        ``no_backward_sync`` stays right; a sum is not, and with ``op="sum"`` gradients are summed at the clip or
        the step instead, as with the node-aware syncs. ``shard="parameters"`` always averages as backward ends (its
        parameters' gradient shards exist only then) and refuses a second backward before the step."""
        return (self.op == "average" and self.sync == "allreduce") or self.shards_parameters

    @property
    def flat_below_bytes(self) -> int:
        return int((FLAT_BELOW_MB if self.flat_below_mb == "auto" else float(self.flat_below_mb)) * 2**20)

    @property
    def tune_hierarchical_route(self) -> bool:
        """``flat_below_mb="auto"``: buckets of FLAT_BELOW_MB or more try both routes, the faster stays."""
        return self.flat_below_mb == "auto"

    def fingerprint(self) -> dict[str, Any]:
        """The settings every rank must share, or the first collective would deadlock.

        ``cpu_threads`` is left out: hosts may differ in cores, and threads never change a collective.
        """
        settings = asdict(self)
        del settings["cpu_threads"]
        for name in ("auto_wrap_policy", "activation_checkpointing_policy"):  # by name: equal on every rank
            settings[name] = describe_policy(getattr(self, name))
        return settings


def unit_policy(policy: object, argument: str = "auto_wrap_policy") -> UnitPolicy:
    """A policy argument checked: module classes (a frozenset of them), a function of a module, or None."""
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return policy
    classes = (policy,) if isinstance(policy, type) else policy
    if isinstance(classes, (set, frozenset, list, tuple)) and classes and all(isinstance(c, type) for c in classes):
        return frozenset(classes)
    raise ValueError(
        f"{argument}={policy!r} must be a set of module classes (for example {{Block}}), a function that "
        "takes a module and says whether it is a unit, or None"
    )


def policy_picks(policy: UnitPolicy, module: Any) -> bool:
    """Whether ``policy`` (module classes or a function of a module; not None) picks ``module``."""
    if isinstance(policy, (set, frozenset)):
        return isinstance(module, tuple(policy))
    return callable(policy) and bool(policy(module))


def describe_policy(policy: UnitPolicy) -> str | None:
    """The policy by the names of its classes or function, alike on every rank (reprs hold addresses)."""
    if policy is None:
        return None
    if callable(policy) and not isinstance(policy, (set, frozenset)):
        return f"{getattr(policy, '__module__', '')}.{getattr(policy, '__qualname__', type(policy).__qualname__)}"
    return ",".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in policy))
