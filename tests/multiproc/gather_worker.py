"""`Distributed.gather_for_metrics` over a sharded loader, as an evaluation loop would use it: 11 samples in
batches of 2, shuffled with the job's seed, two epochs. Rank 0 writes, per epoch, the sample ids and the
"predictions" (twice the id) it gathered, in order.

Usage: python gather_worker.py BACKEND OUT.json (or `run`, from own_loop_worker.py ``--jobs``)
"""

from __future__ import annotations

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain.torch import Distributed

SAMPLES, BATCH = 11, 2


def main() -> None:
    run(sys.argv[1], sys.argv[2])


def run(backend: str, out: str) -> None:
    dist = Distributed(backend, seed=3)
    data = TensorDataset(torch.arange(SAMPLES))
    loader = dist.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
    epochs = []
    for _ in range(2):
        ids, preds = [], []
        for (x,) in loader:
            got_x, got_pred = dist.gather_for_metrics((x, x.float() * 2))
            ids += got_x.tolist()
            preds += got_pred.tolist()
        epochs.append({"ids": ids, "preds": preds})
    if dist.is_main:
        with open(out, "w") as f:
            json.dump({"world": dist.world_size, "epochs": epochs}, f)
    dist.end()


if __name__ == "__main__":
    main()
