"""Objects of the other Lightning package are refused with the import that fixes it."""

from __future__ import annotations

import lightning.pytorch as lp
import pytest
import pytorch_lightning as pl

from hvd_plugins import pytorch as lightning_face
from hvd_plugins import pytorch_lightning as standalone_face


@pytest.mark.parametrize(
    ("trainer_package", "foreign", "import_hint"),
    [
        (pl, lightning_face.HorovodStrategy, "from hvd_plugins.pytorch_lightning import HorovodStrategy"),
        (lp, standalone_face.HorovodStrategy, "from hvd_plugins.pytorch import HorovodStrategy"),
    ],
)
def test_a_strategy_of_the_other_package_is_refused_naming_the_import(trainer_package, foreign, import_hint) -> None:
    with pytest.raises(ValueError) as refused:
        trainer_package.Trainer(strategy=foreign(), accelerator="cpu", devices=1, logger=False)
    assert import_hint in str(refused.value)
