"""Which face of this package serves the Trainer of each Lightning package.

Kept outside the faces: ``hvd_plugins.mirror`` rewrites every ``lightning.pytorch`` in them, this
table's names included.
"""

from __future__ import annotations

TRAINER_FACES = {"lightning.pytorch": "hvd_plugins.pytorch", "pytorch_lightning": "hvd_plugins.pytorch_lightning"}
"""Lightning package of a Trainer -> the face whose classes it takes."""


def other_trainer_face(lightning_package: str) -> tuple[str, str]:
    """For a Trainer package, the other one and the face that serves it."""
    (other,) = (package for package in TRAINER_FACES if package != lightning_package)
    return other, TRAINER_FACES[other]
