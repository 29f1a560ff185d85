"""Which Lightning package this face serves, and clear errors when objects of the other one are mixed in.

``lightning.pytorch`` and ``pytorch_lightning`` hold the same code as separate classes: a Trainer of
one refuses strategies of the other, and callbacks of the other are silently misread. This module's
source serves both faces (``hvd_plugins.mirror`` generates the other from it), so ``LIGHTNING_PACKAGE`` and
``FACE`` name whichever face it was loaded as.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, Trainer

from hvd_plugins.faces import other_trainer_face
from hvd_plugins.pytorch.utilities.callbacks import trainer_callbacks

LIGHTNING_PACKAGE = "lightning.pytorch"
"""The Lightning package this face's classes belong to."""
FACE = "hvd_plugins.pytorch"
"""Where this face's classes are imported from."""


def describe_strategy(strategy: Any) -> str:
    """A repr naming the strategy's Lightning package and the import for the other one."""
    other_package, other_face = other_trainer_face(LIGHTNING_PACKAGE)
    return (
        f"<{FACE}.{type(strategy).__name__} for {LIGHTNING_PACKAGE}.Trainer; a {other_package}.Trainer needs "
        f"`from {other_face} import {type(strategy).__name__}`>"
    )


def require_own_namespace(trainer: Trainer) -> None:
    """Refuse hvd_plugins callbacks built for the other Lightning package, naming the import to use."""
    foreign = [
        callback
        for callback in trainer_callbacks(trainer)
        if type(callback).__module__.startswith("hvd_plugins.") and not isinstance(callback, Callback)
    ]
    if foreign:
        names = ", ".join(sorted({type(callback).__name__ for callback in foreign}))
        raise ValueError(
            f"{names} of {type(foreign[0]).__module__} is a callback for another Lightning package than this "
            f"{LIGHTNING_PACKAGE}.Trainer. Import it as `from {FACE}.callbacks import {names}`."
        )
