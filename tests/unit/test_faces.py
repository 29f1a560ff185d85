"""The two Trainer faces: each subclasses its own Lightning package, written by one rewrite of imports."""

from __future__ import annotations

import lightning.pytorch as lp
import pytorch_lightning as pl

import hvd_plugins
from hvd_plugins import pytorch as lightning_face
from hvd_plugins import pytorch_lightning as standalone_face
from hvd_plugins.mirror import rewrite


def test_each_face_subclasses_its_own_packages_classes() -> None:
    assert issubclass(standalone_face.HorovodStrategy, pl.strategies.ParallelStrategy)
    assert not issubclass(standalone_face.HorovodStrategy, lp.strategies.Strategy)
    assert issubclass(lightning_face.HorovodStrategy, lp.strategies.ParallelStrategy)
    assert issubclass(standalone_face.LineProgressBar, pl.callbacks.ProgressBar)
    assert issubclass(standalone_face.HorovodSyncBatchNorm, pl.plugins.LayerSync)
    assert hvd_plugins.HorovodStrategy is lightning_face.HorovodStrategy  # the short import serves lightning.pytorch
    from hvd_plugins.pytorch_lightning.callbacks import CommunicationMonitor

    assert issubclass(CommunicationMonitor, pl.Callback)


def test_the_rewrite_maps_both_packages_and_both_faces_and_keeps_lines() -> None:
    source = (
        "import lightning.pytorch as pl\n"
        "from lightning.fabric.plugins import CheckpointIO\n"
        "from hvd_plugins.pytorch.callbacks import LineProgressBar\n"
        "from hvd_plugins.fabric import HorovodEnvironment\n"
        "import hvd_plugins.pytorch_lightning\n"
        "from my.lightning.pytorch import x  # not Lightning's\n"
    )
    assert rewrite(source).splitlines() == [
        "import pytorch_lightning as pl",
        "from lightning_fabric.plugins import CheckpointIO",
        "from hvd_plugins.pytorch_lightning.callbacks import LineProgressBar",
        "from hvd_plugins.lightning_fabric import HorovodEnvironment",
        "import hvd_plugins.pytorch_lightning",
        "from my.lightning.pytorch import x  # not Lightning's",
    ]
