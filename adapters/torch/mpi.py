"""``mpi`` for PyTorch: ``.grad``s averaged with ``MPI_Allreduce`` through mpi4py, small tensors fused.

No torch.distributed process group and no autograd hooks: after the backward pass of
the last micro-step (the one not run under ``no_sync``) every parameter's gradient is
averaged across ranks through ``polytrain.comm.mpi_transport``; ``wrap`` broadcasts rank 0's
parameters and buffers so every rank starts alike. For jobs started by an MPI launcher.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from polytrain.adapters.torch.backend import SyncAfterLastBackward, TorchBackend
from polytrain.comm.mpi_transport import MpiCollectives, TrainerCollectivesOverMpi


def _host_view(tensor: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A writeable numpy array of ``tensor``; the flag says whether it must be copied back."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach().numpy(), False
    return tensor.detach().cpu().contiguous().numpy(), True


class MpiBackend(TrainerCollectivesOverMpi, SyncAfterLastBackward, TorchBackend):
    name = "mpi"

    def setup(self) -> None:
        self.mpi = MpiCollectives(self.world.rank, self.world.size, self.world.launcher)
        self.mpi.timeline = self.timeline
        self._params: list[nn.Parameter] = []

    def teardown(self) -> None:
        pass

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        self._params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                array, copy_back = _host_view(tensor)
                self.mpi.broadcast_([array])
                if copy_back:
                    tensor.copy_(torch.from_numpy(array))
        return model, optimizer

    def sync_gradients(self) -> None:
        if self.mpi.size == 1:
            return
        views = []
        for p in self._params:
            if p.grad is None:  # unused on this rank this step: still takes part, with zeros
                p.grad = torch.zeros_like(p)
            views.append((p.grad, *_host_view(p.grad)))
        self.mpi.average_([array for _, array, _ in views])
        with torch.no_grad():
            for grad, array, copy_back in views:
                if copy_back:
                    grad.copy_(torch.from_numpy(array))

    # ---------------------------------------------------------------- collectives for the Trainer
