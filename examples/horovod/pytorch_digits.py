"""Train an MLP on scikit-learn's handwritten digits, the way a Horovod user writes it.

The only change from a Horovod script is the import line. Run with any launcher:

    mpirun -np 2 python examples/horovod/pytorch_digits.py
    torchrun --nproc_per_node=2 examples/horovod/pytorch_digits.py
    horovodrun -np 2 python examples/horovod/pytorch_digits.py
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import polytrain.horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker")
parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)

digits = load_digits()
features = (digits.data / 16.0).astype(np.float32)
x_train, x_val, y_train, y_val = train_test_split(features, digits.target, test_size=0.2, random_state=0,
                                                  stratify=digits.target)
train_set = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
val_set = torch.utils.data.TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val))
# Each worker reads its own shard of the data.
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
val_sampler = torch.utils.data.distributed.DistributedSampler(
    val_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
val_loader = torch.utils.data.DataLoader(val_set, batch_size=256, sampler=val_sampler)

model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 10))
# Horovod's usual recipe: scale the learning rate by the number of workers.
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)

# Start every worker from rank 0's weights and optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def evaluate():
    model.eval()
    correct, total, loss = 0.0, 0.0, 0.0
    with torch.no_grad():
        for data, target in val_loader:
            output = model(data)
            loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += (output.argmax(1) == target).sum().item()
            total += len(target)
    # Sum over workers, then divide: every worker sees the accuracy of the whole validation set.
    totals = hvd.allreduce(torch.tensor([correct, total, loss], dtype=torch.float64), op=hvd.Sum)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[1]).item()


for epoch in range(1, args.epochs + 1):
    model.train()
    train_sampler.set_epoch(epoch)
    running = 0.0
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        running += loss.item()
    train_loss = metric_average(running / len(train_loader), "avg_loss")
    accuracy, val_loss = evaluate()
    if hvd.rank() == 0:
        print(f"epoch {epoch}: train loss {train_loss:.4f}  val loss {val_loss:.4f}  val accuracy {accuracy:.4f}",
              flush=True)

if hvd.rank() == 0:
    print(f"final val accuracy {accuracy:.4f} on {hvd.size()} workers", flush=True)
