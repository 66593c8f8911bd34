"""A hand-written loop on `polytrain.torch.Distributed` (ddp) that saves a checkpoint every 3 of its 6 updates
under ``SAVE_ROOT``, for tests/multiproc/test_slow_storage.py (there each file rank 0 writes is slowed past the
collective timeout). Rank 0 prints ``DONE <steps>`` and the sum of the final weights when the loop ends.

Usage: python slow_save_worker.py STALL_WARNING_S COLLECTIVE_TIMEOUT_S
"""

from __future__ import annotations

import os
import sys

import torch

from polytrain.torch import Distributed

STEPS = 6


def main() -> None:
    warn, timeout = float(sys.argv[1]), float(sys.argv[2])
    dist = Distributed("ddp", spec={"reliability": {"stall_warning_s": warn, "collective_timeout_s": timeout}})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for step in range(1, STEPS + 1):
        with dist.accumulate(model):
            dist.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step % 3 == 0:
            dist.save(os.environ["SAVE_ROOT"], {"model": model, "optimizer": optimizer, "step": step})
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    dist.print(f"DONE {STEPS} {total!r}")
    dist.end()


if __name__ == "__main__":
    main()
