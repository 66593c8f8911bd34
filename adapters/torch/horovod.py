"""``horovod`` for PyTorch: the Trainer's model trained through the Horovod API.

The backend talks to ``polytrain.horovod.torch``, which is the real Horovod under
horovodrun and the MPI launchers (when it is installed) and polytrain's implementation
on torch.distributed everywhere else — so ``backend: horovod`` runs under every
launcher, and on real Horovod wherever real Horovod can form its job.

- ``wrap`` broadcasts rank 0's parameters, buffers and optimizer state and wraps the
  optimizer in ``hvd.DistributedOptimizer`` with ``backward_passes_per_step`` equal to
  ``loop.grad_accum_steps``: gradients are allreduced (asynchronously, during the last
  micro-step's backward) once per optimizer step.
- After that backward the backend calls ``synchronize()``, so the Trainer's clipping,
  fp16 unscaling and NaN checks see averaged gradients; the update then runs under
  ``skip_synchronize()``, Horovod's documented pattern for gradient clipping.
- ``horovod.compression: fp16`` sends gradients as float16 (``hvd.Compression.fp16``).
- The Trainer's own collectives (metrics, start-up check) are ``hvd.allreduce``,
  ``hvd.broadcast_object``, ``hvd.allgather_object`` and ``hvd.barrier``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from polytrain.adapters.torch.backend import SyncAfterLastBackward, TorchBackend
from polytrain.adapters.torch.contract import StepFn
from polytrain.errors import BackendUnavailableError


class HorovodBackend(SyncAfterLastBackward, TorchBackend):
    name = "horovod"
    alters_module = True  # DistributedOptimizer hooks every parameter (real Horovod's hooks cannot be removed)

    def setup(self) -> None:
        import polytrain.horovod.torch as hvd

        self.hvd = hvd
        self.impl = hvd.IMPL
        if self.impl != "horovod":
            # polytrain's implementation joins a process group that already exists: start it here,
            # with the spec's collective timeout.
            super().setup()
            self._adopt_elastic()
        hvd.init()
        if (hvd.rank(), hvd.size()) != (self.world.rank, self.world.size):
            raise BackendUnavailableError(
                f"backend: 'horovod' sees rank {hvd.rank()} of {hvd.size()}, but the launcher "
                f"({self.world.launcher}) says rank {self.world.rank} of {self.world.size}")
        self._optimizer: Any = None
        if self.impl != "horovod" and self.timeline.enabled:  # the shim records each gradient bucket
            from polytrain.horovod.torch.runtime import runtime

            runtime().timeline = self.timeline

    def teardown(self) -> None:
        if getattr(self, "_optimizer", None) is not None and self.impl != "horovod":  # its hooks: a group gone
            from polytrain.horovod.torch.elastic_world import release

            release(self._optimizer)
        self.hvd.shutdown()
        super().teardown()

    def _adopt_elastic(self) -> None:
        """Under polytrain's elastic driver the group is this backend's (`elastic_group`): the shim is told which
        membership version it was formed for."""
        assignment = getattr(self, "assignment", None)
        if assignment is not None:
            from polytrain.horovod.torch import elastic_world

            elastic_world.adopt(assignment)

    def unwrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer.optimizer if optimizer is self._optimizer and optimizer is not None else optimizer

    @property
    def label(self) -> str:
        """``horovod`` plus which implementation runs it (real Horovod or polytrain's)."""
        if self.impl == "horovod":
            return "horovod (Horovod implementation)"
        return f"horovod (polytrain implementation{', over MPI' if self.hvd.mpi_enabled() else ''})"

    @property
    def in_place_refusal(self) -> str | None:
        """polytrain's implementation is re-formed in place (`elastic_world`); real Horovod is not."""
        if self.impl == "horovod":
            return ("backend: 'horovod' recovers in place on polytrain's Horovod implementation, not on real Horovod; "
                    "set POLYTRAIN_HOROVOD_IMPL=shim")
        return None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        hvd = self.hvd
        if not hvd.is_initialized():  # an elastic re-form (`elastic_group.regroup`): the shim on the new group
            self._adopt_elastic()
            hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if optimizer.state:  # a fresh optimizer has nothing to send, and Horovod would first run a
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # zero-gradient step (Adam's step -> 1)
        compression = hvd.Compression.fp16 if self.spec.horovod.compression == "fp16" else hvd.Compression.none
        self._optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression,
            backward_passes_per_step=self.spec.loop.grad_accum_steps, op=hvd.Average)
        return model, self._optimizer

    def sync_gradients(self) -> None:
        # The DistributedOptimizer counts backward passes itself and has started the allreduces
        # during the last backward; this waits for them.
        with self.timeline.span("synchronize gradients", "collective"):
            self._optimizer.synchronize()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: StepFn | None = None) -> bool | None:
        with self._optimizer.skip_synchronize():  # the gradients were synchronised after the last backward
            return super().optimizer_step(optimizer, step)

    # ---------------------------------------------------------------- collectives for the Trainer
    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        return self._started(values, op, f"polytrain.train.trainer.{op}")()

    def start_all_reduce(self, values: np.ndarray, op: str = "sum") -> Callable[[], np.ndarray]:
        return self._started(values, op, f"polytrain.train.trainer.window.{op}")  # its own name: it overlaps others

    def _started(self, values: np.ndarray, op: str, name: str) -> Callable[[], np.ndarray]:
        hvd = self.hvd
        reduce_op = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}[op]
        tensor = torch.tensor(np.asarray(values, dtype=np.float64))  # torch's own memory (see TorchBackend.all_reduce)
        handle = hvd.allreduce_async(tensor, op=reduce_op, name=name)
        return lambda: hvd.synchronize(handle).numpy()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world.size == 1:
            return obj
        # One name on every rank: Horovod's default is the object's type, which differs when only the root has one.
        return self.hvd.broadcast_object(obj, root_rank=src, name="polytrain.train.trainer.broadcast_object")

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self.hvd.allgather_object(obj)) if self.world.size > 1 else [obj]

    def barrier(self) -> None:
        if self.world.size > 1:
            self.hvd.barrier()
