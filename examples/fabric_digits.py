"""Classify scikit-learn's 8x8 digits with a loop written by hand: Lightning Fabric on Horovod.

    horovodrun -np 2 -H localhost:2 --gloo python examples/fabric_digits.py
    python examples/fabric_digits.py --devices 2                  # starts its 2 workers itself
    python examples/fabric_digits.py                              # one process
    mpirun -np 2 --bind-to none python examples/fabric_digits.py  # OpenMPI starts the workers (Horovod built with MPI)
    srun --mpi=pmix python examples/fabric_digits.py              # inside a Slurm job, one task per worker

Rank 0 prints the validation accuracy over every worker's share of the validation set.
"""

import argparse

import torch
from lightning.fabric import Fabric
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hvd_plugins.fabric import HorovodStrategy

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=1, help="workers to start from plain python (default 1)")
parser.add_argument("--epochs", type=int, default=10, help="passes over the data (default 10)")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step (default 2)")
parser.add_argument(
    "--compression", choices=["none", "fp16"], default="none", help="gradients on the wire (default none)"
)
parser.add_argument(
    "--precision", default="32-true", help='e.g. "bf16-mixed", or "16-mixed" on a GPU (default 32-true)'
)
args = parser.parse_args()

# 1. Fabric on Horovod: under horovodrun/mpirun/srun each process is one worker; from plain python
#    with --devices N, launch() starts the other workers.
fabric = Fabric(
    accelerator="auto",
    devices=args.devices,
    strategy=HorovodStrategy(compression=args.compression),
    precision=args.precision,
)
fabric.launch()
fabric.seed_everything(0)

# 2. Data: 1797 images, 360 held out; setup_dataloaders gives each worker its share.
images, labels = load_digits(return_X_y=True)
x_train, x_val, y_train, y_val = train_test_split(images / 16.0, labels, test_size=360, stratify=labels, random_state=0)
train_set = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
val_set = TensorDataset(torch.tensor(x_val, dtype=torch.float32), torch.tensor(y_val))
train_loader, val_loader = fabric.setup_dataloaders(
    DataLoader(train_set, batch_size=32, shuffle=True), DataLoader(val_set, batch_size=120)
)

# 3. Model and optimizer: setup() gives every worker rank 0's weights and wraps the optimizer
#    in Horovod's DistributedOptimizer.
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
model, optimizer = fabric.setup(model, optimizer)

# 4. The loop: accumulate micro-batches without communicating, clip the averaged gradients, step.
for epoch in range(args.epochs):
    model.train()
    for index, (x, y) in enumerate(train_loader):
        stepping = (index + 1) % args.accumulate == 0 or index + 1 == len(train_loader)
        with fabric.no_backward_sync(model, enabled=not stepping):
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss / args.accumulate)
        if stepping:
            fabric.clip_gradients(model, optimizer, max_norm=5.0)
            optimizer.step()
            optimizer.zero_grad()
    mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
    fabric.print(f"epoch {epoch + 1}/{args.epochs}: last batch loss {float(mean_loss):.4f} (mean over workers)")

# 5. Accuracy over every worker's validation batches.
model.eval()
correct = total = torch.zeros((), device=fabric.device)
with torch.no_grad():
    for x, y in val_loader:
        correct = correct + (model(x).argmax(dim=1) == y).sum()
        total = total + y.numel()
correct, total = fabric.all_reduce(correct, reduce_op="sum"), fabric.all_reduce(total, reduce_op="sum")
fabric.print(f"validation accuracy: {float(correct / total):.4f} on {int(total)} images, {fabric.world_size} worker(s)")
