"""A model factory for divergence tests: rank ``NAN_RANK``'s ``NAN_AT``-th training forward returns NaN."""

from __future__ import annotations

import os

import torch
from torch import nn


class NaNOnceMLP(nn.Module):
    def __init__(self, in_features: int, outputs: int) -> None:
        super().__init__()
        self.hidden = nn.ModuleList([nn.Linear(in_features, 32)])
        self.head = nn.Linear(32, outputs)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.relu(self.hidden[0](x.flatten(1))))
        if self.training:
            self.calls += 1
            if os.environ.get("RANK", "0") == os.environ.get("NAN_RANK") and self.calls == int(os.environ["NAN_AT"]):
                out = out * float("nan")
        return out


def make(info, **_: object) -> nn.Module:
    return NaNOnceMLP(int(torch.tensor(info.input_shape).prod()), info.num_outputs)
