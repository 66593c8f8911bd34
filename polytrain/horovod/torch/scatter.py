"""Horovod's alltoall, reducescatter and sparse allreduce, queued like every op (see `pending`).

Alltoall moves rows as raw bytes where gloo has no kernel for the dtype (int16): it is pure data
movement, so any dtype Horovod accepts goes through. Reducescatter gives the first ranks one row
more when the rows do not divide evenly (Horovod's split); like Horovod it supports only
Average and Sum and refuses the rest (Adasum included) with HorovodInternalError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from polytrain.horovod.common import Average, HorovodInternalError, Sum, split_rows
from polytrain.horovod.torch import stall
from polytrain.horovod.torch.collectives import allgather_pending, announce, scale_
from polytrain.horovod.torch.pending import Pending, combine, submit, synchronize
from polytrain.horovod.torch.process_sets import ProcessSet, global_process_set, resolve

#: dtypes gloo's all_to_all has a kernel for; the others travel as bytes
_ALLTOALL_NATIVE = {torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.float32,
                    torch.float64, torch.bfloat16, torch.bool}


# ----------------------------------------------------------------------------- alltoall

def _as_rows_of_bytes(tensor: torch.Tensor) -> torch.Tensor:
    rows = tensor.shape[0]
    return tensor.reshape(rows, -1).view(torch.uint8) if tensor.numel() else tensor.new_empty((rows, 0)).byte()


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start scattering slices of ``tensor`` (dim 0, by ``splits``) to every process.

    ``synchronize`` returns ``(output, received_splits)``.
    """
    tensor = tensor.detach().contiguous()
    group, size, _ = resolve(process_set)
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits needs the first dimension ({rows}) to be divisible "
                             f"by the number of processes ({size})")
        send = [rows // size] * size
    else:
        if isinstance(splits, torch.Tensor) and (splits.is_floating_point() or splits.is_complex()):
            raise ValueError(f"alltoall splits must be an integer tensor, not {splits.dtype}")
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != size or sum(send) != rows or min(send) < 0:
            raise ValueError(f"alltoall splits {send} must hold {size} non-negative counts summing to the "
                             f"first dimension ({rows})")
    out: dict[str, torch.Tensor] = {}

    def launch(pending: Pending) -> None:
        announce(pending, stall.ALLTOALL, [tensor], process_set, uneven=True, needed=True)
        received = out["received"] = torch.empty(size, dtype=torch.int64)
        stall.wait(dist.all_to_all_single(received, torch.tensor(send, dtype=torch.int64), group=group,
                                          async_op=True), pending.label, pending.process_set_id, pending.seq, group)
        recv = received.tolist()
        output = out["output"] = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
        source, target = tensor, output
        if tensor.dtype not in _ALLTOALL_NATIVE:
            source, target = _as_rows_of_bytes(tensor), _as_rows_of_bytes(output)
        pending.works.append(dist.all_to_all_single(target, source, output_split_sizes=recv,
                                                    input_split_sizes=send, group=group, async_op=True))

    return submit(Pending(label=name or "alltoall", name=name, launch=launch,
                          finish=lambda: (out["output"], out["received"].to(torch.int32))), "alltoall")


# ----------------------------------------------------------------------------- reducescatter

def _check_reducescatter_op(op: int) -> None:
    if op not in (Average, Sum):
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM.")


def reducescatter_pending(tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet,
                          prescale_factor: float, postscale_factor: float) -> Pending:
    """A reducescatter, checked and ready to launch (not submitted)."""
    _check_reducescatter_op(op)
    tensor = tensor.detach()
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    _, size, me = resolve(process_set)
    counts = split_rows(tensor.shape[0], size)
    most = counts[0]
    tail = tuple(tensor.shape[1:])
    output = tensor.new_empty((most,) + tail)

    def launch(pending: Pending) -> None:
        announce(pending, stall.REDUCESCATTER, [tensor], process_set, extra=op)
        if most * size == tensor.shape[0]:
            source = tensor.contiguous().clone() if prescale_factor != 1.0 else tensor.contiguous()
        else:
            source = tensor.new_zeros((most * size,) + tail)
            offset = 0
            for i, count in enumerate(counts):
                source[i * most:i * most + count] = tensor[offset:offset + count]
                offset += count
        scale_(source, prescale_factor)
        pending.works.append(dist.reduce_scatter_single(output, source, op=dist.ReduceOp.SUM,
                                                        group=pending.group, async_op=True))

    divisor = size if op == Average else 1
    return Pending(label=name or "reducescatter", name=name, launch=launch,
                   finish=lambda: scale_(output[:counts[me]], postscale_factor / divisor))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over all processes and scattering the result along dim 0."""
    return submit(reducescatter_pending(tensor, name, op, process_set, prescale_factor, postscale_factor),
                  "reducescatter")


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start reducescatters of several tensors; ``synchronize`` returns a list."""
    _check_reducescatter_op(op)
    parts = [reducescatter_pending(t, f"{name}.{i}" if name else None, op, process_set, prescale_factor,
                                   postscale_factor) for i, t in enumerate(tensors)]
    return submit(combine(name or "grouped_reducescatter", name, parts), "reducescatter")


# ----------------------------------------------------------------------------- sparse allreduce

def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by allgathering its indices and values (Horovod's way).

    Returns a function that waits and gives the summed (or averaged) sparse tensor, uncoalesced.
    """
    if op not in (Average, Sum):
        raise ValueError("sparse_allreduce_async supports only hvd.Average and hvd.Sum")
    resolve(process_set)
    indices = submit(allgather_pending(tensor._indices().t().contiguous(), f"{name}.indices", process_set),
                     "allgather")
    values = submit(allgather_pending(tensor._values(), f"{name}.values", process_set), "allgather")
    size = process_set.size()

    def wait() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / size
        if gathered_indices.dim() == 0 or gathered_values.dim() == 0:
            return torch.sparse_coo_tensor(tensor._indices()[:, :0], tensor._values()[:0], tensor.shape)
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape)

    return wait


__all__ = ["alltoall_async", "grouped_reducescatter_async", "reducescatter_async", "sparse_allreduce_async"]
