"""Train a PyTorch model, loss and metric of this script's own with ``polytrain.fit`` on scikit-learn's digits.

The same file runs as one process or under any launcher (each rank runs the whole script):

    python examples/fit/train_torch.py                       # one process
    torchrun --nproc_per_node 2 examples/fit/train_torch.py  # 2 ranks, PyTorch DDP over gloo
    mpirun -np 2 python examples/fit/train_torch.py          # 2 ranks; they agree on a rendezvous over MPI

An optional argument names the output directory (default runs/fit-torch): metrics.jsonl, model.safetensors,
model.json. Reaches about 0.98 validation accuracy in 8 epochs (a few seconds).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import polytrain
from polytrain.environments import detect_world

SMOOTHING = 0.1

SPEC = {
    "seed": 0,
    "data": {"global_batch_size": 64, "val_fraction": 0.2},  # 64 samples a step whatever the number of ranks
    "optimizer": {"name": "adam", "lr": 0.003},
    "loop": {"epochs": 8, "log_every_n_steps": 10},
}


class DigitNet(nn.Module):
    """A small residual MLP over the 8×8 images."""

    def __init__(self, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(64, hidden)
        self.block = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.block(h))


def smoothed_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with label smoothing: one loss per sample (polytrain sums and scales them exactly)."""
    logp = torch.log_softmax(out, dim=-1)
    picked = logp.gather(1, y.view(-1, 1)).squeeze(1)
    return -(1.0 - SMOOTHING) * picked - SMOOTHING * logp.mean(dim=-1)


def confident_accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """1 for a sample classified right with probability above 0.5: one value per sample."""
    prob = torch.softmax(out, dim=-1)
    best, pred = prob.max(dim=-1)
    return ((pred == y) & (best > 0.5)).float()


def main(output: str) -> None:
    bunch = load_digits()  # bundled with scikit-learn: no download
    x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)
    torch.manual_seed(0)  # every rank builds the same model (and polytrain starts all from rank 0's weights)
    result = polytrain.fit({**SPEC, "output": output}, model=DigitNet(), train_data=(x, y),
                           loss=smoothed_cross_entropy, metrics=["accuracy", confident_accuracy])
    if detect_world().rank == 0:
        print(f"val accuracy {result.val_accuracy:.4f}, confident accuracy "
              f"{result.val_metrics['confident_accuracy']:.4f} after {result.global_step} steps; wrote {output}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/fit-torch")
