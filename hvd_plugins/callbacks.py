"""The callbacks of the ``lightning.pytorch`` face, by a short name (``hvd_plugins.pytorch_lightning.callbacks``
has those of ``pytorch_lightning``)."""

from hvd_plugins.pytorch.callbacks import *  # noqa: F403
from hvd_plugins.pytorch.callbacks import __all__  # noqa: F401
