"""Where each collective's data moves: the MPI channel (`mpi`) when it carries the tensors, else torch.distributed.

Every rank picks the same channel for an op: the choice depends only on the process set and
on what every rank announced alike (dtype, device, layout), which the metadata check compares.
gloo has no kernels for int16: broadcasts and gathers move such tensors as bytes, and
reductions run on an int32 copy that is written back when the op is waited for.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from polytrain.horovod.common import Average, Max, Min, Product, Sum
from polytrain.horovod.torch.runtime import runtime

TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


#: dtypes gloo cannot move or reduce itself
_NO_GLOO_KERNEL = (torch.int16,)


class _WrittenBack:
    """A Work whose result lives in a wider copy: waiting copies it back into the caller's tensor."""

    def __init__(self, work: Any, wide: torch.Tensor, tensor: torch.Tensor) -> None:
        self.work, self.wide, self.tensor = work, wide, tensor

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self, timeout: Any = None) -> bool:
        done = self.work.wait(timeout) if timeout is not None else self.work.wait()
        self.tensor.copy_(self.wide)
        return bool(done) if done is not None else True


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.numel() else tensor.new_empty(0, dtype=torch.uint8)


def _engine_for(group: Any, *tensors: torch.Tensor) -> Any:
    engine = runtime().mpi
    return engine if engine is not None and group is None and engine.carries(*tensors) else None


def all_reduce(tensor: torch.Tensor, op: int, group: Any = None) -> Any:
    """Start reducing ``tensor`` in place with Horovod op ``op`` (Average sums; callers scale)."""
    engine = _engine_for(group, tensor)
    if engine is not None:
        return engine.all_reduce(tensor, op)
    if tensor.dtype in _NO_GLOO_KERNEL and not tensor.is_cuda:
        wide = tensor.to(torch.int32)
        return _WrittenBack(dist.all_reduce(wide, op=TORCH_OPS[op], group=group, async_op=True), wide, tensor)
    return dist.all_reduce(tensor, op=TORCH_OPS[op], group=group, async_op=True)


def all_reduce_now(tensor: torch.Tensor, op: int, group: Any = None) -> Any:
    """`all_reduce` for a small op waited for right away: on MPI it runs from the calling thread, on the
    communicator of the metadata records (every rank routes a predicted op here alike, see `speculate`)."""
    engine = _engine_for(group, tensor)
    if engine is not None:
        return engine.all_reduce_now(tensor, op)
    return all_reduce(tensor, op, group)


def broadcast(tensor: torch.Tensor, root: int, group: Any = None) -> Any:
    """Start broadcasting ``tensor`` in place from global rank ``root``."""
    engine = _engine_for(group, tensor)
    if engine is not None:
        return engine.broadcast(tensor, root)
    if tensor.dtype in _NO_GLOO_KERNEL and not tensor.is_cuda:
        tensor = _bytes(tensor)
    return dist.broadcast(tensor, src=root, group=group, async_op=True)


def all_gather(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> Any:
    """Start concatenating equal-sized ``tensor``s of every rank into ``output`` (dim 0)."""
    engine = _engine_for(group, output, tensor)
    if engine is not None:
        return engine.all_gather(output, tensor)
    if tensor.dtype in _NO_GLOO_KERNEL and not tensor.is_cuda:
        output, tensor = _bytes(output), _bytes(tensor)
    return dist.all_gather_single(output, tensor, group=group, async_op=True)
