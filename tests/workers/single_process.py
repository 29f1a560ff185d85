"""A plain script with ``strategy="horovod"``: one process (a world of one), or every worker under horovodrun."""

from __future__ import annotations

import lightning.pytorch as pl
from _common import parse_out, write_result
from models import LinearNet, line_data
from torch import nn
from torch.utils.data import DataLoader

OUT, _ = parse_out()


if __name__ == "__main__":
    import hvd_plugins  # noqa: F401  (registers "horovod")

    data = line_data()
    x, y = data.tensors
    model = LinearNet()
    first = float(nn.functional.mse_loss(model.layer(x), y))
    trainer = pl.Trainer(strategy="horovod", max_epochs=5, logger=False, enable_checkpointing=False)
    trainer.fit(model, DataLoader(data, batch_size=8))
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
