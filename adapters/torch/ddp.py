"""``ddp``: torch DistributedDataParallel over gloo (CPU) or NCCL (GPU)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from polytrain.adapters.torch.backend import TorchBackend


class DDPBackend(TorchBackend):
    name = "ddp"

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers here, so all ranks start equal.
        return DistributedDataParallel(model, device_ids=device_ids), optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return model.no_sync()
