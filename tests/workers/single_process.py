"""A plain script with ``strategy="horovod"``: one process (a world of one), or every worker under horovodrun."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from _common import parse_out, write_result
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OUT, _ = parse_out()


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    import hvd_plugins  # noqa: F401  (registers "horovod")

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    model = Net()
    first = float(nn.functional.mse_loss(model.layer(x), y))
    trainer = pl.Trainer(strategy="horovod", max_epochs=5, logger=False, enable_checkpointing=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    write_result(
        OUT,
        trainer.global_rank,
        {
            "lightning": pl.__name__,
            "strategy_module": type(trainer.strategy).__module__,
            "world_size": trainer.world_size,
            "is_distributed": trainer.strategy.is_distributed,
            "first_loss": first,
            "final_loss": float(trainer.callback_metrics["loss"]),
            "comm_bytes": trainer.strategy.comm_counters.cross_node_bytes
            + trainer.strategy.comm_counters.node_local_bytes,
        },
    )
