"""What every sync mode offers: how gradients are averaged, the training loop's events, and what the mode owns.

Lightning calls ``optimizer.step(closure)`` and the closure runs backward, so gradients may
only be averaged after the closure ran. The strategy therefore keeps the optimizer from
synchronizing on its own (``deferred``) and calls ``synchronize`` right after backward,
before gradient clipping and the AMP unscale see the gradients.

A sync mode owns its state (the hierarchical route, DASO's schedule, shards) and answers the
strategy's questions, so a strategy wires any mode the same way and never asks which one it has,
and never reads every gradient or the whole optimizer state itself:

- the training loop's events (``setup``, epoch and batch events, ``state_dict``/``load_state_dict``);
- the gradients this worker owns once averaged (``owned_gradients``: the finite check reads them);
- clipping by the global norm or by value (``clip_grad_norm_``, ``clip_grad_value_``);
- the optimizer state to save or commit and to load (``optimizer_state_dict``, ``load_optimizer_state_dict``),
  and the model's (``model_state_dict``, ``load_model_state_dict``: the faces save and load the model through
  them, so a mode that splits parameters can gather and split them);
- whether an elastic reset must build the mode again (``world_shaped``), whether every worker holds
  the whole optimizer state (``replicates_optimizer_state``), and what an elastic commit keeps of it
  (``committing``).

The defaults here are those of a mode in which every worker holds every averaged gradient and the
whole optimizer state; a mode that shards overrides them.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from hvd_plugins.core.checkpoint.dcp_read import by_parameter_index, by_parameter_name
from hvd_plugins.core.checkpoint.dcp_source import DcpSource, read_model
from hvd_plugins.core.comm.parameters import optimizer_parameters
from hvd_plugins.core.comm.shards import LocalShard
from hvd_plugins.core.comm.topology import Topology

OWN_PARTS_KEY = "held"
"""In an elastic commit, what an optimizer state keeps under this key is this worker's own (a sharded mode's parts):
every worker restores the snapshot rank 0 shares, but keeps these of its own (``core.elastic.snapshot``)."""


class TrainingLoopHooks:
    """What a sync mode may do at the training loop's events; each hook does nothing unless overridden."""

    def setup(self, model: Module, optimizers: Sequence[Optimizer], total_epochs: int | None) -> None:
        """Once the wrapped optimizers exist and every worker holds the same parameters."""

    def on_train_epoch_start(self) -> None:
        """At every training epoch's start, after callbacks that (un)freeze parameters."""

    def on_train_batch_start(self) -> None:
        """Before every training batch."""

    def after_optimizer_step(self, last_batch_of_epoch: bool) -> None:
        """After every batch that stepped the optimizers."""

    def on_train_epoch_end(self, epoch_loss: Callable[[], float | None]) -> None:
        """After the epoch's last batch, on every worker; ``epoch_loss()`` is a collective (the all-worker mean)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this sync (empty: nothing)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what ``state_dict`` returned; may come before ``setup``."""

    def teardown(self, optimizers: Sequence[Optimizer]) -> None:
        """After a fit: forget its optimizers, so a later fit in this process starts clean (state is kept)."""

    def refuse_unsupported(self, accumulate_grad_batches: int, clips_gradients: bool) -> None:
        """Before the first step: raise, naming the setting, for training this sync cannot do."""

    def refuse_grad_scaler(self, grad_scaler: object | None) -> None:
        """Before the first step: raise if this sync cannot train under ``grad_scaler`` (a ``16-mixed`` GradScaler)."""


class GradientSync(TrainingLoopHooks, ABC):
    """Averages the gradients of one optimizer's parameters across workers, follows the training loop, and says
    what this worker owns of the gradients and the optimizer state.

    A new mode subclasses this, implements ``synchronize`` (and whatever else it changes), and takes one
    line in ``core.sync.table``. The loop hooks do nothing here.
    """

    backward_passes: int = 1  # micro-batches accumulated into one optimizer step
    topology: Topology | None = None  # the node layout, for the node-aware modes
    world_shaped: bool = False
    """Whether the mode holds a layout of the world (node groups, shards): an elastic reset then builds
    it again from the config, keeping its ``state_dict``; otherwise it follows the new world in place."""
    replicates_optimizer_state: bool = True
    """Whether every worker holds the whole optimizer state, alike: then a face may broadcast rank 0's after a
    load. A sharded mode holds slices, and its ``state_dict`` is a collective of every worker."""

    # ------------------------------------------------------------------ averaging
    def wrap(self, optimizer: Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Optimizer:
        """Return the optimizer the Trainer should use (possibly a wrapper)."""
        return optimizer

    @contextlib.contextmanager
    def deferred(self, optimizer: Optimizer) -> Iterator[None]:
        """Keep ``optimizer.step`` from synchronizing by itself."""
        yield

    @abstractmethod
    def synchronize(self, optimizer: Optimizer) -> None:
        """Average the gradients now; called once per optimizer step, after backward."""

    def set_backward_passes(self, optimizer: Optimizer, passes: int) -> None:
        """Tell the sync how many backward passes accumulate into one step."""
        self.backward_passes = passes

    def hold_next_backward(self, optimizer: Optimizer) -> None:
        """The next backward only adds to the gradients (a loop's ``no_backward_sync``); explicit syncs wait anyway."""

    def before_backward(self, optimizer: Optimizer) -> None:
        """Before every backward: settle what an earlier backward of this step started, if anything."""

    def started(self, optimizer: Optimizer) -> bool:
        """Whether a backward since the last sync gave ``optimizer``'s parameters gradients to average."""
        return any(p.grad is not None for p in optimizer_parameters(optimizer))

    # ------------------------------------------------------------------ what this worker owns
    def owned_gradients(self, optimizer: Optimizer) -> list[torch.Tensor]:
        """The averaged gradients this worker owns after ``synchronize`` (here: every parameter's that has one)."""
        return [p.grad for p in optimizer_parameters(optimizer) if p.grad is not None]

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged gradients by their norm over the whole model, and return that norm.

        Every worker holds every averaged gradient here, so the norm needs no collective; a mode
        whose workers own slices sums the slices' powers across workers in one collective.
        """
        return torch.nn.utils.clip_grad_norm_(
            optimizer_parameters(optimizer), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp every averaged gradient this worker owns to ``[-clip_value, clip_value]``."""
        torch.nn.utils.clip_grad_value_(optimizer_parameters(optimizer), clip_value)

    def optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's whole state, as a checkpoint or an elastic commit keeps it (any world size can load it)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        """Take back what ``optimizer_state_dict`` returned, saved at any world size."""
        optimizer.load_state_dict(dict(state))

    def model_state_dict(self, model: Module) -> dict[str, Any]:
        """The model's whole state, as a checkpoint keeps it: here every worker holds every parameter."""
        return model.state_dict()

    def model_pieces(self, model: Module) -> dict[str, Any]:
        """The model's state as a DCP checkpoint saves it, no gather: what this worker holds whole as it is (DCP
        writes each such tensor once), a sharded parameter as this worker's part of it (``FlatPieces``)."""
        return self.model_state_dict(model)

    def optimizer_pieces(self, optimizer: Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
        """The optimizer's state as a DCP checkpoint saves it, keyed by parameter name (``names``: ``saved_names``
        of the model): here the whole state, which every worker holds."""
        return by_parameter_name(self.optimizer_state_dict(optimizer), optimizer, names)

    def load_model_pieces(self, model: Module, source: DcpSource, strict: bool = True) -> None:
        """The model's state read from a DCP checkpoint in place, each worker only the boxes of what it holds
        (``model_pieces``: the live tensors it holds whole, its pieces of a sharded parameter)."""
        read_model(source, self.model_pieces(model), strict, type(model).__name__)

    def load_optimizer_pieces(self, optimizer: Optimizer, model: Module, source: DcpSource) -> None:
        """The optimizer's state from a DCP checkpoint (keyed by the names of ``model``'s parameters): here whole,
        as every worker holds it."""
        whole = source.read(lambda path: True)
        self.load_optimizer_state_dict(optimizer, by_parameter_index(whole, optimizer, model))

    def load_model_state_dict(self, model: Module, state: Mapping[str, Any], strict: bool = True) -> None:
        """Take back a whole model state, saved at any world size or by one process."""
        model.load_state_dict(state, strict=strict)

    def whole_numel(self, parameter: torch.nn.Parameter) -> int:
        """How many elements ``parameter`` has in the whole model (here every worker holds it whole)."""
        return parameter.numel()

    def local_shards(self) -> dict[str, LocalShard]:
        """This worker's part of each parameter, where parameters are sharded (``shard="parameters"``)."""
        raise ValueError(
            f"local_shards: {type(self).__name__} keeps every parameter whole on every worker; only "
            "shard='parameters' splits them (model.state_dict() gives them whole)"
        )

    def abandon(self, optimizers: Sequence[Optimizer]) -> None:
        """After an elastic reset, before the mode is dropped: ``teardown`` without any collective (the world it
        was set up in is gone). A mode whose teardown runs none keeps this."""
        self.teardown(optimizers)

    @contextlib.contextmanager
    def committing(self) -> Iterator[None]:
        """Inside, ``optimizer_state_dict`` gives what an elastic commit keeps in host memory. Here the whole state,
        which every worker holds; a sharded mode keeps its own part and a copy of another worker's instead, under
        ``OWN_PARTS_KEY``."""
        yield
