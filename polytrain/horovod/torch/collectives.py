"""Horovod's asynchronous collectives: ``*_async`` → int handle → ``poll``/``synchronize``.

Each op first exchanges a small metadata record with the other ranks (see `stall`; this
blocks until every rank has submitted the op), then launches the data's collective
asynchronously — on torch.distributed, or on MPI under an MPI launcher (see `transport`, `mpi`) —
and returns; the data moves in the background. ``synchronize`` waits (monitored for
stalls) and returns the output. Ops must be submitted in the same order
on every rank — Horovod matches them by name instead; here a different order is reported
as a mismatch on every rank rather than reordered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from polytrain.horovod.common import Adasum, Average, Sum, reduce_op_name, resolve_average, split_rows
from polytrain.horovod.torch import stall, transport
from polytrain.horovod.torch.process_sets import ProcessSet, global_process_set, resolve
from polytrain.horovod.torch.runtime import runtime
from polytrain.timeline import COLLECTIVES


@dataclass
class Pending:
    """One submitted collective: what to wait for and how to produce its output."""

    label: str
    process_set_id: int
    seq: int
    group: Any
    works: list[Any] = field(default_factory=list)
    finish: Callable[[], Any] = lambda: None
    kind: str = ""
    nbytes: int = 0
    started: float = 0.0  # timeline clock, when the op was submitted (metadata exchange included)

    def done(self) -> bool:
        return all(w is None or w.is_completed() for w in self.works)

    def result(self) -> Any:
        for work in self.works:
            stall.wait(work, self.label, self.process_set_id, self.seq, self.group)
        timeline = runtime().timeline
        if timeline.enabled:
            timeline.complete(self.label, "collective", self.started, timeline.now(), track=COLLECTIVES,
                              op=self.kind, bytes=self.nbytes, process_set=self.process_set_id)
        return self.finish()


def submit(pending: Pending) -> int:
    state = runtime()
    handle = state.next_handle
    state.next_handle += 1
    state.handles[handle] = pending
    return handle


def poll(handle: int) -> bool:
    """True when the op behind ``handle`` has completed (``synchronize`` will not block)."""
    pending = runtime().handles.get(handle)
    if pending is None:
        raise ValueError(f"handle {handle} is not a pending Horovod operation")
    return pending.done()


def synchronize(handle: int) -> Any:
    """Wait for the op behind ``handle`` and return its output (None for an unknown handle)."""
    pending = runtime().handles.pop(handle, None)
    if pending is None:
        return None
    return pending.result()


def resolve_op(op: int | None, average: bool | None) -> int:
    """Horovod's op/average rule (`polytrain.horovod.common.resolve_average`), refusing Adasum."""
    op = resolve_average(op, average)
    if op == Adasum:
        raise ValueError("op=hvd.Adasum is not supported by polytrain's Horovod shim; use hvd.Average or "
                         "hvd.Sum, or run real Horovod (POLYTRAIN_HOROVOD_IMPL=horovod)")
    reduce_op_name(op)
    return op


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place; integer tensors are scaled in double precision and truncated, like Horovod."""
    if factor == 1.0:
        return tensor
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            return tensor.mul_(factor)
        return tensor.copy_((tensor.double() * factor).to(tensor.dtype))


def announce(kind: int, name: str | None, tensors: Sequence[torch.Tensor], process_set: ProcessSet,
             extra: int = 0, uneven: bool = False, needed: bool = False) -> tuple[Pending, torch.Tensor | None]:
    """Exchange and verify this op's metadata record before any data moves.

    Verifying first matters: gloo aborts the whole process (std::terminate) when ranks
    exchange buffers of different sizes. The exchange is skipped when the check is off,
    unless the caller ``needed`` the other ranks' records (allgather and alltoall sizes).
    Returns the op's Pending (works not yet added) and the records, if exchanged.
    """
    group, size, _ = resolve(process_set)
    set_id = process_set.process_set_id
    seq = stall.next_seq(set_id)
    label = name or f"{stall.KIND_NAMES[kind]}.noname.{seq}"
    pending = Pending(label=label, process_set_id=set_id, seq=seq, group=group)
    timeline = runtime().timeline
    if timeline.enabled:
        pending.kind, pending.started = stall.KIND_NAMES[kind], timeline.now()
        pending.nbytes = sum(t.numel() * t.element_size() for t in tensors)
    checking = runtime().settings.metadata_check
    if not needed and not checking:
        return pending, None
    record = stall.make_record(kind, name, tensors, extra=extra, uneven=uneven)
    work, records = stall.start_exchange(record, group, size)
    stall.wait(work, label, set_id, seq, group)
    if checking:
        joined_ok = kind in (stall.ALLREDUCE, stall.GROUPED_ALLREDUCE, stall.OPTIMIZER) and set_id == 0
        stall.verify(records, name, group, set_id, seq, uneven=uneven, joined_ok=joined_ok)
    return pending, records


# ----------------------------------------------------------------------------- allreduce

def _allreduce_async(tensor: torch.Tensor, output: torch.Tensor, name: str | None, op: int,
                     prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> int:
    pending, _ = announce(stall.ALLREDUCE, name, [tensor], process_set, extra=op)
    if output is not tensor:
        with torch.no_grad():
            output.copy_(tensor)
    scale_(output, prescale_factor)
    pending.works.append(transport.all_reduce(output, op, pending.group))
    divisor = process_set.size() if op == Average else 1

    def finish() -> torch.Tensor:
        return scale_(output, postscale_factor / divisor)

    pending.finish = finish
    return submit(pending)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start averaging/summing ``tensor`` over all processes; the input is not modified."""
    op = resolve_op(op, average)
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _allreduce_async(tensor.detach(), output, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place `allreduce_async`: ``synchronize`` returns ``tensor`` holding the result."""
    op = resolve_op(op, average)
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


def _grouped_allreduce_async(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor] | None,
                             name: str | None, op: int, prescale_factor: float, postscale_factor: float,
                             process_set: ProcessSet) -> int:
    """Fuse ``tensors`` into one flat buffer per dtype: one collective however many tensors."""
    tensors = [t.detach() for t in tensors]
    pending, _ = announce(stall.GROUPED_ALLREDUCE, name, tensors, process_set, extra=op)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(index)
    buffers = []
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices]) if indices else torch.empty(0, dtype=dtype)
        scale_(flat, prescale_factor)
        pending.works.append(transport.all_reduce(flat, op, pending.group))
        buffers.append((indices, flat))
    divisor = process_set.size() if op == Average else 1

    def finish() -> list[torch.Tensor]:
        results: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        for indices, flat in buffers:
            scale_(flat, postscale_factor / divisor)
            for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
                if outputs is not None:
                    with torch.no_grad():
                        results[i] = outputs[i].copy_(piece.view_as(outputs[i]))
                else:
                    results[i] = piece.view(tensors[i].shape)
        return results

    pending.finish = finish
    return submit(pending)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start one fused allreduce of a list of tensors; ``synchronize`` returns a list."""
    return _grouped_allreduce_async(tensors, None, name, resolve_op(op, average), prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """In-place `grouped_allreduce_async`."""
    return _grouped_allreduce_async(tensors, list(tensors), name, resolve_op(op, average),
                                    prescale_factor, postscale_factor, process_set)


# ----------------------------------------------------------------------------- allgather

def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating ``tensor`` from every process along dim 0 (dim 0 may differ)."""
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    pending, records = announce(stall.ALLGATHER, name, [tensor], process_set, uneven=True, needed=True)
    rows = [int(r) for r in records[:, stall.DIM0]]
    most = max(rows)
    tail = tuple(tensor.shape[1:])
    source = tensor.contiguous()
    if source.shape[0] != most:
        source = torch.cat([source, source.new_zeros((most - source.shape[0],) + tail)])
    gathered = tensor.new_empty((most * len(rows),) + tail)
    pending.works.append(transport.all_gather(gathered, source, pending.group))

    def finish() -> torch.Tensor:
        if all(r == most for r in rows):
            return gathered
        return torch.cat([gathered[i * most:i * most + r] for i, r in enumerate(rows)])

    pending.finish = finish
    return submit(pending)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathers of several tensors; ``synchronize`` returns a list."""
    handles = [allgather_async(t, f"{name}.{i}" if name else None, process_set) for i, t in enumerate(tensors)]
    state = runtime()
    parts = [state.handles.pop(h) for h in handles]
    first = parts[0] if parts else None
    pending = Pending(label=name or "grouped_allgather", process_set_id=process_set.process_set_id,
                      seq=first.seq if first else 0, group=first.group if first else None)
    pending.works = [w for p in parts for w in p.works]
    pending.finish = lambda: [p.finish() for p in parts]
    return submit(pending)


# ----------------------------------------------------------------------------- broadcast

def _broadcast_async(tensor: torch.Tensor, output: torch.Tensor, root_rank: int, name: str | None,
                     process_set: ProcessSet) -> int:
    if process_set.ranks and root_rank not in process_set.ranks:
        raise ValueError(f"root_rank={root_rank} is not in {process_set}")
    pending, _ = announce(stall.BROADCAST, name, [tensor], process_set, extra=root_rank)
    if output is not tensor:
        with torch.no_grad():
            output.copy_(tensor)
    pending.works.append(transport.broadcast(output, root_rank, pending.group))
    pending.finish = lambda: output
    return submit(pending)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start broadcasting ``tensor`` from global rank ``root_rank``; the input is not modified."""
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _broadcast_async(tensor.detach(), output, root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place `broadcast_async`."""
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


# ----------------------------------------------------------------------------- alltoall

def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start scattering slices of ``tensor`` (dim 0, by ``splits``) to every process.

    ``synchronize`` returns ``(output, received_splits)``.
    """
    tensor = tensor.detach().contiguous()
    group, size, _ = resolve(process_set)
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits needs the first dimension ({rows}) to be divisible "
                             f"by the number of processes ({size})")
        send = [rows // size] * size
    else:
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != size or sum(send) != rows or min(send) < 0:
            raise ValueError(f"alltoall splits {send} must hold {size} non-negative counts summing to the "
                             f"first dimension ({rows})")
    pending, _ = announce(stall.ALLTOALL, name, [tensor], process_set, uneven=True, needed=True)
    received = torch.empty(size, dtype=torch.int64)
    stall.wait(dist.all_to_all_single(received, torch.tensor(send, dtype=torch.int64), group=group,
                                      async_op=True), pending.label, pending.process_set_id, pending.seq, group)
    recv = received.tolist()
    output = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
    pending.works.append(dist.all_to_all_single(output, tensor, output_split_sizes=recv, input_split_sizes=send,
                                                group=group, async_op=True))
    pending.finish = lambda: (output, received.to(torch.int32))
    return submit(pending)


# ----------------------------------------------------------------------------- reducescatter

def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over all processes and scattering the result along dim 0."""
    if op not in (Average, Sum):
        raise ValueError("Reducescatter currently only supports AVERAGE and SUM.")
    tensor = tensor.detach()
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    pending, _ = announce(stall.REDUCESCATTER, name, [tensor], process_set, extra=op)
    _, size, me = resolve(process_set)
    counts = split_rows(tensor.shape[0], size)
    most = counts[0]
    tail = tuple(tensor.shape[1:])
    if most * size == tensor.shape[0]:
        source = tensor.contiguous().clone() if prescale_factor != 1.0 else tensor.contiguous()
    else:
        source = tensor.new_zeros((most * size,) + tail)
        offset = 0
        for i, count in enumerate(counts):
            source[i * most:i * most + count] = tensor[offset:offset + count]
            offset += count
    scale_(source, prescale_factor)
    output = tensor.new_empty((most,) + tail)
    pending.works.append(dist.reduce_scatter_single(output, source, op=dist.ReduceOp.SUM, group=pending.group,
                                                    async_op=True))
    divisor = size if op == Average else 1
    pending.finish = lambda: scale_(output[:counts[me]], postscale_factor / divisor)
    return submit(pending)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start reducescatters of several tensors; ``synchronize`` returns a list."""
    handles = [reducescatter_async(t, f"{name}.{i}" if name else None, op, process_set, prescale_factor,
                                   postscale_factor) for i, t in enumerate(tensors)]
    state = runtime()
    parts = [state.handles.pop(h) for h in handles]
    pending = Pending(label=name or "grouped_reducescatter", process_set_id=process_set.process_set_id,
                      seq=parts[0].seq if parts else 0, group=parts[0].group if parts else None)
    pending.works = [w for p in parts for w in p.works]
    pending.finish = lambda: [p.finish() for p in parts]
    return submit(pending)


# ----------------------------------------------------------------------------- barrier

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every process of ``process_set`` reaches the barrier."""
    if runtime().settings.metadata_check:
        announce(stall.BARRIER, None, [], process_set, needed=True)
        return
    group, _, _ = resolve(process_set)
    seq = stall.next_seq(process_set.process_set_id)
    stall.wait(dist.barrier(group=group, async_op=True), "barrier", process_set.process_set_id, seq, group)


__all__ = [
    "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather_async",
    "grouped_allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async", "reducescatter_async",
    "grouped_reducescatter_async", "barrier", "poll", "synchronize",
]
