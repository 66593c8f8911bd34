"""A hand-written loop on `polytrain.torch.Distributed` (ddp) with a fault on one rank, for the stall warning and
the failure report: ``FAULT_MODE=sleep`` sleeps ``FAULT_SLEEP`` seconds on rank ``FAULT_RANK`` before the forward
pass of update ``FAULT_AT`` (a stalled rank: the others wait in that step's backward); ``FAULT_MODE=kill``
SIGKILLs that rank there (the others' backward fails). Rank 0 prints ``DONE <steps>`` when the loop ends.

Usage: python loop_fault_worker.py STALL_WARNING_S COLLECTIVE_TIMEOUT_S
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from polytrain.torch import Distributed

STEPS = 8


def main() -> None:
    warn, timeout = float(sys.argv[1]), float(sys.argv[2])
    fault_rank, fault_at = int(os.environ["FAULT_RANK"]), int(os.environ["FAULT_AT"])
    dist = Distributed("ddp", spec={"reliability": {"stall_warning_s": warn, "collective_timeout_s": timeout}})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for step in range(1, STEPS + 1):
        if step == fault_at and dist.rank == fault_rank:
            if os.environ["FAULT_MODE"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(os.environ["FAULT_SLEEP"]))
        with dist.accumulate(model):
            dist.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    dist.print(f"DONE {STEPS}")
    dist.end()


if __name__ == "__main__":
    main()
