"""Knowledge-graph embedding (ComplEx, 1-vs-all training) on a synthetic graph: Trainer on HorovodStrategy.

    horovodrun -np 2 -H localhost:2 --gloo python examples/kg_embedding.py --epochs 40
    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/kg_embedding.py --sync hierarchical
    python examples/kg_embedding.py --devices 2                   # starts its 2 workers itself
    python examples/kg_embedding.py                               # one process
    mpirun -np 2 --bind-to none python examples/kg_embedding.py   # OpenMPI starts the workers (Horovod built with MPI)
    srun --mpi=pmix python examples/kg_embedding.py               # inside a Slurm job, one task per worker

The graph is generated, the same on every worker: each entity has two hidden cyclic coordinates
(a cluster 0..9 and a position 0..19) and each relation shifts both by fixed amounts, so (head,
relation) determines the tail. A tenth of the triples is held out; predicting them needs the structure
learned from the others. ComplEx can represent the shifts exactly (as rotations), so a filtered MRR
close to 1 is reachable. Rank 0 prints the filtered MRR and Hits@10 on the held-out triples (tails,
and heads through reciprocal relations) over every worker's share, writes ``<out-dir>/logs/metrics.csv``
and plots it to ``<out-dir>/kg_embedding.png``.
"""

from __future__ import annotations

import argparse
import csv
import warnings
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from matplotlib.figure import Figure
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from hvd_plugins.pytorch import HorovodStrategy

# 1. Settings.
parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--epochs", type=int, default=40, help="training epochs")
parser.add_argument("--lr", type=float, default=0.02, help="Adam's learning rate")
parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none", help="gradients on the wire")
parser.add_argument(
    "--sync",
    choices=["allreduce", "hierarchical", "daso"],
    default="allreduce",
    help="flat allreduce; node, then across nodes; or DASO (with DasoConfig's defaults)",
)
parser.add_argument("--devices", type=int, default=1, help="workers to start from plain python")
parser.add_argument("--out-dir", type=Path, default=Path("runs"), help="where the CSV log and the plot go")
parser.add_argument("--no-progress-bar", action="store_true", help="no progress bar (the CSV log stays)")
args = parser.parse_args()
CLUSTERS, POSITIONS, RELATIONS = 10, 20, 4
ENTITIES = CLUSTERS * POSITIONS
RANK = 16  # complex embedding dimension
BATCH_SIZE = 64  # triples per worker per step
warnings.filterwarnings("ignore", ".*does not have many workers.*")  # tiny in-memory data
seed_everything(0, workers=True)

# 2. Data. Relation r maps entity (c, p) to (c + a_r mod CLUSTERS, p + b_r mod POSITIONS).
shifts = [(1 + 3 * r % CLUSTERS, 2 + 5 * r) for r in range(RELATIONS)]
graph = torch.tensor(
    [
        (head, r, (head // POSITIONS + a) % CLUSTERS * POSITIONS + (head % POSITIONS + b) % POSITIONS)
        for head in range(ENTITIES)
        for r, (a, b) in enumerate(shifts)
    ]
)
order = torch.randperm(len(graph), generator=torch.Generator().manual_seed(0))
held_out_count = len(graph) // 10 // 8 * 8  # a multiple of 8, so the DistributedSampler pads nothing
train, held_out = graph[order[held_out_count:]], graph[order[:held_out_count]]


def with_reciprocals(part: torch.Tensor) -> torch.Tensor:
    """Add (tail, r + RELATIONS, head) for each (head, r, tail): predicting a head becomes predicting a tail."""
    return torch.cat([part, torch.stack([part[:, 2], part[:, 1] + RELATIONS, part[:, 0]], dim=1)])


# Every true tail of each (head, relation), for the filtered ranking.
every_triple = with_reciprocals(graph)
known = torch.zeros(ENTITIES * 2 * RELATIONS, ENTITIES, dtype=torch.bool)
known[every_triple[:, 0] * 2 * RELATIONS + every_triple[:, 1], every_triple[:, 2]] = True
train_loader = DataLoader(TensorDataset(with_reciprocals(train)), batch_size=BATCH_SIZE, shuffle=True)
held_out_loader = DataLoader(TensorDataset(with_reciprocals(held_out)), batch_size=256)


# 3. Model.
class ComplEx(LightningModule):
    """Scores every entity as the tail of (head, relation): Re(<h, r, conj(t)>)."""

    def __init__(self, entities: int, relations: int, rank: int, lr: float, known: torch.Tensor) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["known"])
        self.entity = nn.Embedding(entities, 2 * rank)
        self.relation = nn.Embedding(2 * relations, 2 * rank)  # with the reciprocal relations
        nn.init.normal_(self.entity.weight, std=0.1)
        nn.init.normal_(self.relation.weight, std=0.1)
        self.register_buffer("known", known, persistent=False)
        self.mrr = MeanMetric()  # reduced over all workers by HorovodStrategy
        self.hits_at_10 = MeanMetric()

    def forward(self, heads: torch.Tensor, relations: torch.Tensor) -> torch.Tensor:
        h_re, h_im = self.entity(heads).chunk(2, dim=1)
        r_re, r_im = self.relation(relations).chunk(2, dim=1)
        t_re, t_im = self.entity.weight.chunk(2, dim=1)
        query_re, query_im = h_re * r_re - h_im * r_im, h_re * r_im + h_im * r_re
        return query_re @ t_re.T + query_im @ t_im.T

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (triples,) = batch
        scores = self(triples[:, 0], triples[:, 1])  # every entity but the true tail is a negative
        loss = nn.functional.cross_entropy(scores, triples[:, 2], label_smoothing=0.1)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (triples,) = batch
        scores = self(triples[:, 0], triples[:, 1])
        target = scores.gather(1, triples[:, 2:3])
        # Filtered: the other true tails of the same (head, relation) do not count against the target.
        others = self.known[triples[:, 0] * self.relation.num_embeddings + triples[:, 1]].clone()
        others[torch.arange(len(triples)), triples[:, 2]] = False
        rank = 1 + ((scores > target) & ~others).sum(dim=1).float()
        self.mrr.update(1.0 / rank)
        self.hits_at_10.update((rank <= 10).float())
        self.log("val_mrr", self.mrr, on_epoch=True, prog_bar=True)
        self.log("val_hits_at_10", self.hits_at_10, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


model = ComplEx(ENTITIES, RELATIONS, RANK, args.lr, known)

# 4. The Trainer on HorovodStrategy. Under horovodrun, mpirun or srun every process is one worker;
#    from plain python, --devices N starts the other N - 1 workers when fit begins.
trainer = Trainer(
    strategy=HorovodStrategy(compression=args.compression, sync=args.sync),
    accelerator="auto",
    devices=args.devices,
    max_epochs=args.epochs,
    logger=CSVLogger(args.out_dir, name="", version="logs"),  # <out-dir>/logs/metrics.csv
    enable_progress_bar=not args.no_progress_bar,
    enable_checkpointing=False,
    enable_model_summary=False,
    log_every_n_steps=1,
)

# 5. Fit: each worker trains on its share of the triples and ranks its share of the held-out ones.
trainer.fit(model, train_loader, held_out_loader)
mrr, hits = float(trainer.callback_metrics["val_mrr"]), float(trainer.callback_metrics["val_hits_at_10"])

# 6. Result, on rank 0: the CSV log per epoch as a plot, then the ranking quality.
if trainer.is_global_zero:
    metrics_csv = args.out_dir / "logs" / "metrics.csv"
    with open(metrics_csv, newline="") as file:
        rows = list(csv.DictReader(file))
    figure = Figure(figsize=(9, 3.6), layout="tight")
    panels = {"loss": ["train_loss"], "held-out ranking": ["val_mrr", "val_hits_at_10"]}
    for axis, (title, names) in zip(figure.subplots(1, 2), panels.items(), strict=True):
        for name in names:
            by_epoch = {int(row["epoch"]): float(row[name]) for row in rows if row.get(name)}
            axis.plot(list(by_epoch), list(by_epoch.values()), marker="o", markersize=3, label=name)
        axis.set(title=title, xlabel="epoch")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(
        f"ComplEx, synthetic graph: {trainer.world_size} worker(s), compression={args.compression}, sync={args.sync}"
    )
    figure.savefig(args.out_dir / "kg_embedding.png", dpi=110)
    print(f"log: {metrics_csv}")
    print(f"plot: {args.out_dir / 'kg_embedding.png'}")
    print(f"held-out filtered MRR: {mrr:.4f}  hits@10: {hits:.4f}")
