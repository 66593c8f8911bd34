"""``ddp``: torch DistributedDataParallel over gloo (CPU) or NCCL (GPU)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from polytrain.adapters.torch.backend import TorchBackend
from polytrain.adapters.torch.execution import compile_module
from polytrain.observe.timeline import COLLECTIVES


class DDPBackend(TorchBackend):
    """DDP reduces the gradient buckets itself; where the Trainer checks them for NaN/Inf (`checks_finite`) or
    records a timeline, its buckets go through `_reduce_bucket`, which sums each bucket and then, in one pass
    over the reduced values while they are in cache (on the collective's thread, as the backward goes on),
    averages them and notes whether any is NaN/Inf. `grads_finite` then reads one flag instead of making a
    second pass over every gradient after the step's backward."""

    name = "ddp"
    _found: torch.Tensor | None = None  # 1 once a reduced bucket held a NaN/Inf, until `grads_finite` reads it

    #: every rank holds the whole model and optimizer: its own commit is enough to go on after a lost peer
    in_place_refusal = None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.ensure_process_group()  # one process (backend: ddp asked for explicitly): DDP still needs a group
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers here, so all ranks start equal.
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        if self.checks_finite or self.timeline.enabled:
            self._found = torch.zeros(1, device=self.device)
            self._inverse = torch.full((1,), 1.0 / dist.get_world_size(), device=self.device)
            # a lambda: DDP checks the hook's annotations against classes, and ours are strings here
            ddp.register_comm_hook(None, lambda state, bucket: self._reduce_bucket(bucket))
        self._wrapper = weakref.ref(ddp)  # what an own-loop script holds after `end()` (the Trainer lets go first)
        return ddp, optimizer

    def teardown(self) -> None:
        wrapper = self._wrapper() if getattr(self, "_wrapper", None) is not None else None
        self._wrapper = None
        if wrapper is not None:
            run_locally(wrapper)
        super().teardown()

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """One gradient bucket: summed over the ranks, then (in the future's callback) divided by their number
        and checked for NaN/Inf in the same pass (the kernel GradScaler unscales with), on the timeline when
        one is recorded (start, end, bytes). The mean of a power-of-two number of ranks is bit-identical to
        DDP's own (which divides each rank's gradient before the sum)."""
        timeline, started = self.timeline, self.timeline.now()
        buffer = bucket.buffer()
        nbytes, index = buffer.numel() * buffer.element_size(), bucket.index()

        def averaged(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = future.value()[0]
            torch._amp_foreach_non_finite_check_and_unscale_([reduced], self._found, self._inverse)
            if timeline.enabled:
                timeline.complete(f"gradient bucket {index}", "collective", started, timeline.now(),
                                  track=COLLECTIVES, op="allreduce", bytes=nbytes)
            return reduced

        return dist.all_reduce(buffer, async_op=True).get_future().then(averaged)

    def grads_finite(self, model: nn.Module) -> bool:
        if self._found is None or not self.checks_finite:
            return super().grads_finite(model)
        finite = not self._found.item()
        self._found.zero_()
        return finite

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
