"""Where each collective's data moves: the MPI channel (`mpi`) when it carries the tensors, else torch.distributed.

Every rank picks the same channel for an op: the choice depends only on the process set and
on what every rank announced alike (dtype, device, layout), which the metadata check compares.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from polytrain.horovod.common import Average, Max, Min, Product, Sum
from polytrain.horovod.torch.runtime import runtime

TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


def _engine_for(group: Any, *tensors: torch.Tensor) -> Any:
    engine = runtime().mpi
    return engine if engine is not None and group is None and engine.carries(*tensors) else None


def all_reduce(tensor: torch.Tensor, op: int, group: Any = None) -> Any:
    """Start reducing ``tensor`` in place with Horovod op ``op`` (Average sums; callers scale)."""
    engine = _engine_for(group, tensor)
    if engine is not None:
        return engine.all_reduce(tensor, op)
    return dist.all_reduce(tensor, op=TORCH_OPS[op], group=group, async_op=True)


def broadcast(tensor: torch.Tensor, root: int, group: Any = None) -> Any:
    """Start broadcasting ``tensor`` in place from global rank ``root``."""
    engine = _engine_for(group, tensor)
    if engine is not None:
        return engine.broadcast(tensor, root)
    return dist.broadcast(tensor, src=root, group=group, async_op=True)


def all_gather(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> Any:
    """Start concatenating equal-sized ``tensor``s of every rank into ``output`` (dim 0)."""
    engine = _engine_for(group, output, tensor)
    if engine is not None:
        return engine.all_gather(output, tensor)
    return dist.all_gather_single(output, tensor, group=group, async_op=True)
