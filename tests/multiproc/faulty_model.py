"""A model factory for fault-injection tests: an MLP whose rank ``FAULT_RANK`` SIGKILLs itself (or, with
``FAULT_MODE=sleep``, sleeps ``FAULT_SLEEP`` seconds: a stalled rank; with ``FAULT_MODE=raise``, raises
a ``RuntimeError``: a bug on one rank).

Used through the spec's import-path escape hatch (``model.name: faulty_model:make``). The kill
happens at the ``FAULT_AT``-th training forward of the first attempt only (restart count 0), so
an elastic restart runs clean.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn


class FaultyMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, outputs: int) -> None:
        super().__init__()
        self.hidden = nn.ModuleList([nn.Linear(in_features, hidden)])
        self.head = nn.Linear(hidden, outputs)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            first_attempt = max(int(os.environ.get(v, "0")) for v in ("TORCHELASTIC_RESTART_COUNT",
                                                                       "POLYTRAIN_RESTART_COUNT")) == 0
            rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))  # torchrun-style, or mpirun
            if (first_attempt and rank == os.environ.get("FAULT_RANK")
                    and self.calls == int(os.environ.get("FAULT_AT", "-1"))):
                if os.environ.get("FAULT_MODE") == "sleep":  # a stalled rank (stuck I/O, a debugger)
                    time.sleep(float(os.environ.get("FAULT_SLEEP", "10")))
                elif os.environ.get("FAULT_MODE") == "raise":
                    raise RuntimeError(f"injected failure on rank {rank}")
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
        return self.head(torch.relu(self.hidden[0](x.flatten(1))))


def make(info, hidden: int = 64) -> nn.Module:
    size = 1
    for d in info.input_shape:
        size *= d
    return FaultyMLP(size, hidden, info.num_outputs)
