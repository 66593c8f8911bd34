"""A Horovod script on polytrain's shim: ``hvd.init``, ``DistributedOptimizer``, a few steps, and the end of the
script with ``hvd.shutdown()`` (argument ``shutdown``) or without it (the shim's exit handler then ends it).

Run by tests/multiproc/test_clean_exit.py, which sets ``POLYTRAIN_HOROVOD_IMPL=shim``. With ``shutdown`` it
checks that nothing of the shim runs on afterwards (no torch.distributed group, no gloo or store thread).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from clean_exit_fit import native_threads, say
from torch import nn

import polytrain.horovod.torch as hvd


def main(mode: str) -> None:
    hvd.init()
    torch.manual_seed(hvd.rank())  # different starts: broadcast_parameters makes them rank 0's
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    data = torch.Generator().manual_seed(100 + hvd.rank())  # each rank its own samples
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
        optimizer.step()
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    say(f"RESULT rank {hvd.rank()} of {hvd.size()} weights {digest:.9e}")
    if mode == "shutdown":
        hvd.shutdown()
        assert not dist.is_initialized(), "torch.distributed is still initialised after hvd.shutdown()"
        assert not native_threads(), f"process group or store threads alive after hvd.shutdown(): {native_threads()}"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
