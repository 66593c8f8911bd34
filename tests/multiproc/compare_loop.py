"""A hand-written loop as `polytrain compare --script` runs it: the backend and the number of steps from
`polytrain.compare.backend`/`steps`, each step's loss and the final weights through `polytrain.compare.Record`.

The digits MLP, SGD with momentum; each step's global batch of 32 is split over the ranks (rank r takes every
world-th sample). Usage: python compare_loop.py [--lr LR] (default 0.1).
"""

from __future__ import annotations

import sys

import torch
from sklearn.datasets import load_digits
from torch import nn

from polytrain import compare
from polytrain.torch import Distributed

GLOBAL_BATCH = 32


def main() -> None:
    lr = float(sys.argv[sys.argv.index("--lr") + 1]) if "--lr" in sys.argv else 0.1
    bunch = load_digits()
    x = torch.tensor(bunch.data / 16.0, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    dist = Distributed(compare.backend("ddp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    record = compare.Record(dist)
    for step in range(compare.steps(20)):
        start = step * GLOBAL_BATCH % (len(x) - GLOBAL_BATCH)
        rows = slice(start + dist.rank, start + GLOBAL_BATCH, dist.world_size)
        loss = nn.functional.cross_entropy(model(x[rows].to(dist.device)), y[rows].to(dist.device))
        dist.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        record.step(dist.all_reduce(loss.detach()))
    record.save(model)
    dist.end()


if __name__ == "__main__":
    main()
