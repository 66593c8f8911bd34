"""``ddp``: torch DistributedDataParallel over gloo (CPU) or NCCL (GPU)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from polytrain.adapters.torch.backend import TorchBackend
from polytrain.adapters.torch.execution import compile_module
from polytrain.timeline import COLLECTIVES


class DDPBackend(TorchBackend):
    name = "ddp"

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.ensure_process_group()  # one process (backend: ddp asked for explicitly): DDP still needs a group
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers here, so all ranks start equal.
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        if self.timeline.enabled:
            # a lambda: DDP checks the hook's annotations against classes, and ours are strings here
            ddp.register_comm_hook(None, lambda state, bucket: self._timed_allreduce(state, bucket))
        self._wrapper = weakref.ref(ddp)  # what an own-loop script holds after `end()` (the Trainer lets go first)
        return ddp, optimizer

    def teardown(self) -> None:
        wrapper = self._wrapper() if getattr(self, "_wrapper", None) is not None else None
        self._wrapper = None
        if wrapper is not None:
            run_locally(wrapper)
        super().teardown()

    def _timed_allreduce(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's own allreduce of one gradient bucket, recorded on the timeline (start, end, bytes)."""
        timeline, started = self.timeline, self.timeline.now()
        buffer = bucket.buffer()
        nbytes, index = buffer.numel() * buffer.element_size(), bucket.index()

        def done(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            timeline.complete(f"gradient bucket {index}", "collective", started, timeline.now(), track=COLLECTIVES,
                              op="allreduce", bytes=nbytes)
            return future.value()

        return default_hooks.allreduce_hook(state, bucket).then(done)

    def compile_model(self, model: nn.Module, mode: str) -> None:
        """The DDP module, in place: dynamo splits its graph at DDP's gradient buckets (DDPOptimizer), so
        each bucket's all-reduce still starts during the backward pass."""
        compile_module(model, mode)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return model.no_sync()


def run_locally(ddp: DistributedDataParallel) -> None:
    """After the job: DDP's reducer (C++, out of `rendezvous.let_go_of`'s reach) holds the process group, so it
    goes, and the wrapper a script keeps runs its module on this process as it is — forward and backward, no
    gradient synchronisation (there is no group left to synchronise over)."""
    ddp._pre_forward = lambda *inputs, **kwargs: (inputs, kwargs)
    ddp._post_forward = lambda output: output
    ddp.reducer = ddp.logger = None
