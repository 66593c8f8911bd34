"""A model factory for the async-checkpoint kill test: an MLP with hidden layers wide enough that writing its
checkpoint takes many training steps, which SIGKILLs its own process at a training forward while a background
save is being written (its temporary directory exists) and an earlier checkpoint is complete — when
``KILL_MID_SAVE`` names the checkpoint directory. Used as ``model.name: kill_mid_save:make``."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn


class KillMidSave(nn.Module):
    def __init__(self, in_features: int, hidden: int, outputs: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                  nn.ReLU(), nn.Linear(hidden, outputs))
        root = os.environ.get("KILL_MID_SAVE")
        self.root = Path(root) if root else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.root is not None and (self.root / "latest").exists() \
                and any(self.root.glob(".tmp-step-*")):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.body(x)


def make(info: Any, hidden: int = 1536) -> nn.Module:
    torch.manual_seed(0)
    return KillMidSave(int(torch.tensor(info.input_shape).prod()), hidden, info.num_outputs)
