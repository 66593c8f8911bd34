"""A model factory that records the samples it trains on: each training forward appends one line (the hex of
every input row's float32 bytes) to ``$SEEN_DIR/rank-<RANK>.jsonl``. Evaluation forwards are not recorded;
a rank's n-th line is its n-th micro-step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn


class SeenMLP(nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(inputs, 16)
        self.head = nn.Linear(16, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            rows = x.detach().cpu().to(torch.float32).numpy()
            line = json.dumps([row.tobytes().hex() for row in rows])
            path = Path(os.environ["SEEN_DIR"]) / f"rank-{os.environ.get('RANK', '0')}.jsonl"
            with path.open("a") as f:
                f.write(line + "\n")
        return self.head(torch.relu(self.hidden(x.flatten(1))))


def make(info: Any, **_: object) -> nn.Module:
    return SeenMLP(int(torch.tensor(info.input_shape).prod()), info.num_outputs)
