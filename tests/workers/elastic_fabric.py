"""A Fabric loop run by ``hvd_plugins.fabric.ElasticLoop`` under an elastic horovodrun, a worker killed or hosts
added as in elastic_training.py (same events, same cues: ``elastic_common``)."""

from __future__ import annotations

import horovod.torch as hvd
import torch
from elastic_common import Events, leave_or_grow, parser
from lightning.fabric import Fabric
from models import ELASTIC_FEATURES, IndexedData
from torch import nn

from hvd_plugins.fabric import ElasticLoop, HorovodStrategy


def main() -> None:
    args = parser().parse_args()
    events = Events(args.out)
    fabric = Fabric(strategy=HorovodStrategy(), accelerator="cpu")
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(ELASTIC_FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    data = IndexedData()
    loop = ElasticLoop(fabric, commit_every_n_steps=args.commit_every, model=model, optimizer=optimizer, trained=0)

    @loop.run
    def train(loop: ElasticLoop) -> None:
        events.write("train_start", rank=hvd.rank(), size=hvd.size(), step=loop.step)
        for epoch in loop.epochs(100):
            for x, y, index in loop.batches(data, batch_size=8):
                if loop.step >= args.max_steps:
                    return
                leave_or_grow(args, events, loop.step)
                loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
                optimizer.zero_grad()
                fabric.backward(loss)
                optimizer.step()
                loop.trained += 1  # a plain value: rolled back with the rest
                events.write(
                    "batch", epoch=epoch, step=loop.step, rank=hvd.rank(), size=hvd.size(), indices=index.tolist()
                )

    train()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    events.write(
        "end", rank=hvd.rank(), size=hvd.size(), step=loop.step, weights=weights.tolist(), resets=loop.resets,
        trained=loop.trained,
    )  # fmt: skip


if __name__ == "__main__":
    main()
