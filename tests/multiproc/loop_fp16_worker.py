"""A hand-written fp16 loop on `polytrain.torch.Distributed` with an injected inf: 6 updates of a small MLP on a
fixed global batch of 16 (rank r takes every world-th row), the loss of update 3 multiplied by inf on the last
rank only (on one process: on the whole batch). Rank 0 writes, per update, whether the optimizer applied it and
the loss scale after it, and whether every rank holds the same weights at the end.

Usage: python loop_fp16_worker.py BACKEND OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
from clean_exit_fit import native_threads

from polytrain.torch import Distributed

INF_AT = 3


def main() -> None:
    backends, out = sys.argv[1:3]
    for backend in backends.split(","):  # several: one session after another, OUT per backend ({backend})
        run(backend, out.replace("{backend}", backend))


def run(backend: str, out: str) -> None:
    dist = Distributed(backend, precision="fp16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    rows = slice(dist.rank, None, dist.world_size)
    applied, scales = [], []
    for update in range(1, 7):
        loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
        if update == INF_AT and dist.rank == dist.world_size - 1:
            loss = loss * float("inf")
        dist.backward(loss)
        applied.append(optimizer.step())
        optimizer.zero_grad()
        scales.append(float(dist._scaler.get_scale()))
    flat = torch.cat([v.flatten().double() for v in dist.get_state_dict(model).values()])
    same = bool(torch.equal(dist.all_reduce(flat, "max"), dist.all_reduce(flat, "min")))
    dist.end()
    left = native_threads()  # none, with the model and optimizer still held here (fsdp's scaler held the group)
    if dist.is_main:
        with open(out, "w") as f:
            json.dump({"world": dist.world_size, "applied": applied, "scales": scales, "same": same,
                       "finite": bool(torch.isfinite(flat).all()), "threads_left": left}, f)


if __name__ == "__main__":
    main()
