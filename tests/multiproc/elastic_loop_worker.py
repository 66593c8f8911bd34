"""A hand-written loop that keeps training in place (tests/multiproc/test_elastic_own_loop.py): `Distributed`,
``dist.elastic_state`` and ``dist.elastic_run``, as a script has them.

A 3-class problem of N samples (an index dataset: the loop reads each batch's rows from fixed tensors), a small
MLP, SGD with momentum, 3 samples per rank per step (the global batch is 9), 2 epochs, ``state.commit()`` every
``EVERY`` steps. After each optimizer step every rank appends to ``OUT/steps.jsonl`` its pid, spawn rank, world size,
the round (how many times the body started in this process), the step and the rows it trained with the weight its
loss had. With ``--kill STEP:RANK`` the process spawned as rank RANK SIGKILLs itself right after writing STEP's
record. At the end rank 0 writes the model's weights to ``OUT/weights.json``.

Usage: python elastic_loop_worker.py BACKEND OUT [--kill STEP:RANK]
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from polytrain.torch import Distributed

N, BATCH, EPOCHS, EVERY = 40, 3, 2, 2


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 6, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)


def main(backend: str, out: Path, kill: tuple[int, int] | None) -> None:
    x, y = data()
    dist = Distributed(backend)
    net = model()
    net, opt = dist.setup(net, optimizer(net))
    loader = dist.setup_dataloaders(DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH, shuffle=True))
    state = dist.elastic_state(epoch=0, step=0)
    spawn_rank = int(os.environ["HOROVOD_RANK"])  # never rewritten: the rank this process was started as
    rounds = [-1]

    @dist.elastic_run
    def train(state: object) -> None:
        rounds[0] += 1
        for epoch in range(state.epoch, EPOCHS):
            for (rows,) in loader:
                loss = nn.functional.cross_entropy(state.model(x[rows]), y[rows])
                dist.backward(loss)
                state.optimizer.step()
                state.optimizer.zero_grad()
                state.step += 1
                record = {"pid": os.getpid(), "spawn": spawn_rank, "rank": dist.rank, "size": dist.world_size,
                          "round": rounds[0], "step": state.step, "rows": rows.tolist(),
                          "weight": loader.loading.place.weight}
                with open(out / "steps.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                if kill == (state.step, spawn_rank):
                    os.kill(os.getpid(), signal.SIGKILL)
                if state.step % EVERY == 0:
                    state.commit()
            state.epoch = epoch + 1

    train(state)
    weights = {k: v.tolist() for k, v in dist.get_state_dict(state.model).items()}
    if dist.is_main:
        (out / "weights.json").write_text(json.dumps(weights))
    dist.end()


if __name__ == "__main__":
    killing = sys.argv[sys.argv.index("--kill") + 1].split(":") if "--kill" in sys.argv else None
    main(sys.argv[1], Path(sys.argv[2]), (int(killing[0]), int(killing[1])) if killing else None)
