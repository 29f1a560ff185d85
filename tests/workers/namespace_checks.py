"""One plain process with both Lightning packages: what a ``pytorch_lightning`` Trainer takes and refuses.

Run as its own process (Trainers start Horovod, which a test process must not do).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from _common import Checks, parse_out, write_result
from pytorch_lightning.demos.boring_classes import BoringModel

from hvd_plugins import pytorch as lightning_face
from hvd_plugins import pytorch_lightning as standalone_face

checks = Checks()


def trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


@checks.register
def check_name_and_instance() -> dict[str, Any]:
    by_name = trainer(strategy="horovod_fp16")
    given = standalone_face.HorovodStrategy(sync="hierarchical")
    return {
        "by_name_class": f"{type(by_name.strategy).__module__}.{type(by_name.strategy).__name__}",
        "by_name_compression": by_name.strategy.config.compression,
        "instance_kept": trainer(strategy=given).strategy is given,
    }


@checks.register
def check_foreign_callback() -> str | None:
    try:
        trainer(strategy=standalone_face.HorovodStrategy(), callbacks=[lightning_face.CommunicationMonitor()]).fit(
            BoringModel()
        )
    except ValueError as error:
        return str(error)
    return None


if __name__ == "__main__":
    OUT, _ = parse_out()
    write_result(OUT, 0, checks.run())
