"""Keep your own PyTorch training loop: `Distributed` puts a hand-written loop on any of polytrain's
data-parallel backends (local, ddp, fsdp, horovod, mpi) under any launcher, through the same backend objects
the Trainer uses. See `polytrain.torch.distributed`."""

from polytrain.torch.distributed import Distributed, OwnLoopError

__all__ = ["Distributed", "OwnLoopError"]
