"""What a 2-worker job prints: the progress display, warnings and rank-zero messages.

The test reads the job's combined output (horovodrun prefixes each line with ``[rank]<stream>:``);
this worker emits marked warnings and messages on every rank and reports named checks per rank.
"""

from __future__ import annotations

import io
import warnings
from contextlib import redirect_stdout
from typing import Any

import torch
from _common import Checks, parse_out, write_result
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from models import TinyRegression
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.core.backend.module import horovod_torch
from hvd_plugins.pytorch import HorovodStrategy

MARK = "console-check"
checks = Checks()


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 1)), batch_size=8)


def fit(**trainer_kwargs: Any) -> Trainer:
    trainer = Trainer(
        strategy=HorovodStrategy(),
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(TinyRegression(warning=f"{MARK}: warning during training"), loader(), loader())
    return trainer


@checks.register
def default_bar() -> str:
    """Lightning's default bar under horovodrun: this fit's progress goes to the job's output."""
    return type(fit().progress_bar_callback).__name__


@checks.register
def given_bar_kept() -> dict[str, Any]:
    """A TQDMProgressBar the user passed stays; its redraws are captured here, not in the job's output."""
    captured = io.StringIO()
    with redirect_stdout(captured):
        trainer = fit(callbacks=[TQDMProgressBar()])
    return {"type": type(trainer.progress_bar_callback).__name__, "carriage_returns": captured.getvalue().count("\r")}


@checks.register
def disabled_bar() -> str | None:
    bar = fit(enable_progress_bar=False).progress_bar_callback
    return None if bar is None else type(bar).__name__


@checks.register
def warning_as_error_raises() -> bool:
    """Silencing warnings on ranks > 0 must not swallow a warning that the filters turn into an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            warnings.warn(f"{MARK}: escalated", UserWarning, stacklevel=1)
        except UserWarning:
            return True
    return False


if __name__ == "__main__":
    OUT, _ = parse_out()
    # Emitted by every rank before any Trainer or Horovod exists.
    warnings.warn(f"{MARK}: warning before the Trainer", UserWarning, stacklevel=1)
    rank_zero_info(f"{MARK}: rank-zero info before the Trainer")
    seed_everything(0)  # Lightning logs "Seed set to 0" on every worker, with no rank
    report = checks.run()
    write_result(OUT, horovod_torch().rank(), report)
