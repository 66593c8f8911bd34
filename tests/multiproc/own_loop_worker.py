"""A hand-written training loop on `polytrain.torch.Distributed`, as a script would have it: the digits MLP,
SGD with momentum, 2 micro-steps of accumulation, clipping that bites, 20 optimizer steps. Each micro-step's
global batch of 32 is split across the ranks (rank r takes every world-th sample), so any world size sees the
same samples per update. Rank 0 writes every micro-step's loss (averaged over the ranks) and the final weights.

Usage: python own_loop_worker.py BACKEND OUT.json [--launch NP [--fail-rank R]]
(``--launch``: the script starts its NP processes itself through `Distributed.launch`, the ``mp.spawn`` case;
``--fail-rank``: that rank raises before training, to see the others stopped and the failure named.)
"""

from __future__ import annotations

import json
import sys

import torch
from sklearn.datasets import load_digits
from torch import nn

from polytrain.torch import Distributed, OwnLoopError

GLOBAL_BATCH, ACCUM, STEPS, CLIP = 32, 2, 20, 0.5


def train(backend: str, out: str, fail_rank: int = -1) -> None:
    spec = None
    if backend.startswith("deepspeed"):  # "deepspeed-3": ZeRO stage 3; the engine clips at the spec's norm
        backend, stage = "deepspeed", int(backend.partition("-")[2] or 2)
        spec = {"deepspeed": {"stage": stage}, "loop": {"grad_clip_norm": CLIP}, "output": f"{out}.deepspeed"}
    dist = Distributed(backend, grad_accum_steps=ACCUM, spec=spec)
    if dist.rank == fail_rank:
        raise RuntimeError(f"rank {dist.rank} fails on purpose")
    bunch = load_digits()
    x = torch.tensor(bunch.data / 16.0, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    torch.manual_seed(0 if dist.is_main else 1)  # setup gives every rank rank 0's weights
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = dist.setup(model, optimizer)
    refused = ""
    if dist.backend_name == "deepspeed":  # a norm other than the engine's is refused in one line
        try:
            dist.clip_grad_norm_(model, CLIP / 2)
        except OwnLoopError as exc:
            refused = str(exc)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            start = (step * ACCUM + micro) * GLOBAL_BATCH % (len(x) - GLOBAL_BATCH)
            rows = slice(start + dist.rank, start + GLOBAL_BATCH, dist.world_size)
            xb, yb = x[rows].to(dist.device), y[rows].to(dist.device)
            with dist.accumulate(model):
                loss = nn.functional.cross_entropy(model(xb), yb)
                dist.backward(loss)
            losses.append(float(dist.all_reduce(loss.detach(), "mean")))
        norm = dist.clip_grad_norm_(model, CLIP)
        norms.append(None if norm is None else float(norm))
        optimizer.step()
        optimizer.zero_grad()
    state = dist.get_state_dict(model)
    if dist.is_main:
        with open(out, "w") as f:
            json.dump({"backend": dist.backend_name, "world": dist.world_size, "refused": refused, "losses": losses, "norms": norms,
                       "weights": {k: v.flatten().tolist() for k, v in state.items()}}, f)
    dist.end()


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    if "--launch" not in sys.argv:
        train(backend, out)
        return
    np = int(sys.argv[sys.argv.index("--launch") + 1])
    fail = int(sys.argv[sys.argv.index("--fail-rank") + 1]) if "--fail-rank" in sys.argv else -1
    Distributed.launch(train, backend, out, fail, np=np)


if __name__ == "__main__":
    main()
