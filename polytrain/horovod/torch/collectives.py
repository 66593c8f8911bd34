"""Horovod's asynchronous collectives: ``*_async`` → int handle → ``poll``/``synchronize``.

Each ``*_async`` call checks what it can alone and queues the op (see `pending`: the rule that
keeps ranks in step on errors). When launched, the op first exchanges a small metadata record
with the other ranks (see `stall`; this blocks until every rank has launched the op), then
starts the data's collective asynchronously — on torch.distributed, or on MPI under an MPI
launcher (see `transport`, `mpi`). ``synchronize`` waits (monitored for stalls) and returns the
output. Ops must be launched in the same order on every rank — Horovod matches them by name
instead; here a different order is reported as a mismatch on every rank rather than reordered.
Alltoall and reducescatter are in `scatter`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from polytrain.horovod.common import Adasum, Average, reduce_op_name, resolve_average
from polytrain.horovod.torch import speculate, stall, transport
from polytrain.horovod.torch.pending import Pending, combine, poll, submit, synchronize
from polytrain.horovod.torch.process_sets import ProcessSet, global_process_set, resolve
from polytrain.horovod.torch.runtime import runtime

#: the ops a rank inside ``hvd.join()`` takes part in (with zeros); the others are refused
JOINABLE = (stall.ALLREDUCE, stall.GROUPED_ALLREDUCE)


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


def announce(pending: Pending, kind: int, tensors: Sequence[torch.Tensor], process_set: ProcessSet,
             extra: int = 0, uneven: bool = False, needed: bool = False,
             payload: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor | speculate.Hit | None:
    """Exchange and verify this op's metadata record before any data moves (at launch).

    Verifying first matters: gloo aborts the whole process (std::terminate) when ranks
    exchange buffers of different sizes. The exchange is skipped when the check is off,
    unless the caller ``needed`` the other ranks' records (allgather and alltoall sizes),
    and when every rank sent the op the ranks predicted (`speculate`; ``payload`` makes this
    rank's data for it): then the op is done, and its result comes back as `speculate.Hit`.
    Fills in ``pending``'s place in the sequence; returns the records, if exchanged.
    """
    group, size, _ = resolve(process_set)
    set_id = process_set.process_set_id
    seq = stall.next_seq(set_id)
    pending.label = pending.name or f"{stall.KIND_NAMES[kind]}.noname.{seq}"
    pending.process_set_id, pending.seq, pending.group = set_id, seq, group
    timeline = runtime().timeline
    if timeline.enabled:
        pending.kind, pending.started = stall.KIND_NAMES[kind], timeline.now()
        pending.nbytes = sum(t.numel() * t.element_size() for t in tensors)
    checking = runtime().settings.metadata_check
    if not needed and not checking:
        return None
    row = stall.record_row(kind, pending.name, tensors, extra=extra, uneven=uneven)
    hit = speculate.slot(set_id, row, group, size, pending.label, seq, payload)
    if hit is not None:
        return hit
    work, records = stall.start_exchange(torch.tensor(row, dtype=torch.int64), group, size)
    stall.wait(work, pending.label, set_id, seq, group)
    speculate.learn(set_id, records, extra, speculate.allreduce_pieces(row, tensors[0].device) if tensors else None)
    if checking:
        stall.verify(records, pending.name, group, set_id, seq, uneven=uneven,
                     joined_ok=kind in JOINABLE and set_id == 0)
    return records


def flagged(tensors: Sequence[torch.Tensor], prescale_factor: float, flag: int) -> torch.Tensor:
    """``tensors`` flattened into one buffer, pre-scaled, with ``flag`` appended (a predicted op's data): one
    concatenation, this module's per-op cost being what a predicted small allreduce adds to the op itself."""
    first = tensors[0]
    key = (first.dtype, first.device, flag)
    tail = _FLAG_TAILS.get(key)
    if tail is None:
        tail = _FLAG_TAILS[key] = torch.full((1,), flag, dtype=first.dtype, device=first.device)
    buffer = torch.cat([*(t.detach().reshape(-1) for t in tensors), tail])
    if prescale_factor != 1.0:  # (scale_ runs under no_grad itself)
        scale_(buffer[:-1], prescale_factor)
    return buffer


#: the one-element flag tensors `flagged` appends, by (dtype, device, flag)
_FLAG_TAILS: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}


def contiguous(tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


# ----------------------------------------------------------------------------- allreduce

def _allreduce_async(tensor: torch.Tensor, output: torch.Tensor, name: str | None, op: int,
                     prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> int:
    _, size, _ = resolve(process_set)

    def launch(pending: Pending) -> None:
        answer = announce(pending, stall.ALLREDUCE, [tensor], process_set, extra=op,
                          payload=lambda flag: flagged([tensor], prescale_factor, flag))
        if isinstance(answer, speculate.Hit):  # reduced already, in the predicted op's buffer
            with torch.no_grad():
                output.view(-1).copy_(answer.data)
            return
        if output is not tensor:
            with torch.no_grad():
                output.copy_(tensor)
        scale_(output, prescale_factor)
        pending.works.append(transport.all_reduce(output, op, pending.group))

    divisor = size if op == Average else 1
    return submit(Pending(label=name or "allreduce", name=name, launch=launch,
                          finish=lambda: scale_(output, postscale_factor / divisor)), "allreduce")


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
    contiguous(tensor)
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


def _grouped_allreduce_async(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor] | None,
                             name: str | None, op: int, prescale_factor: float, postscale_factor: float,
                             process_set: ProcessSet) -> int:
    """Fuse ``tensors`` into one flat buffer per dtype: one collective however many tensors."""
    tensors = [t.detach() for t in tensors]
    _, size, _ = resolve(process_set)
    buffers: list[tuple[list[int], torch.Tensor]] = []

    def launch(pending: Pending) -> None:
        answer = announce(pending, stall.GROUPED_ALLREDUCE, tensors, process_set, extra=op,
                          payload=lambda flag: flagged(tensors, prescale_factor, flag))
        if isinstance(answer, speculate.Hit):  # one dtype, reduced already
            buffers.append((list(range(len(tensors))), answer.data))
            return
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(index)
        for indices in by_dtype.values():
            flat = torch.cat([tensors[i].reshape(-1) for i in indices])
            scale_(flat, prescale_factor)
            pending.works.append(transport.all_reduce(flat, op, pending.group))
            buffers.append((indices, flat))

    divisor = size if op == Average else 1

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

    return submit(Pending(label=name or "grouped_allreduce", name=name, launch=launch, finish=finish),
                  "allreduce")


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
    for tensor in tensors:
        contiguous(tensor)
    return _grouped_allreduce_async(tensors, list(tensors), name, resolve_op(op, average),
                                    prescale_factor, postscale_factor, process_set)


# ----------------------------------------------------------------------------- allgather

def allgather_pending(tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> Pending:
    """An allgather, checked and ready to launch (not submitted)."""
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    resolve(process_set)
    out: dict[str, Any] = {}

    def launch(pending: Pending) -> None:
        records = announce(pending, stall.ALLGATHER, [tensor], process_set, uneven=True, needed=True)
        rows = out["rows"] = [int(r) for r in records[:, stall.DIM0]]
        most = max(rows)
        tail = tuple(tensor.shape[1:])
        source = tensor.contiguous()
        if source.shape[0] != most:
            source = torch.cat([source, source.new_zeros((most - source.shape[0],) + tail)])
        gathered = out["gathered"] = tensor.new_empty((most * len(rows),) + tail)
        pending.works.append(transport.all_gather(gathered, source, pending.group))

    def finish() -> torch.Tensor:
        rows, gathered = out["rows"], out["gathered"]
        most = max(rows)
        if all(r == most for r in rows):
            return gathered
        return torch.cat([gathered[i * most:i * most + r] for i, r in enumerate(rows)])

    return Pending(label=name or "allgather", name=name, launch=launch, finish=finish)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating ``tensor`` from every process along dim 0 (dim 0 may differ)."""
    return submit(allgather_pending(tensor, name, process_set), "allgather")


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathers of several tensors; ``synchronize`` returns a list."""
    parts = [allgather_pending(t, f"{name}.{i}" if name else None, process_set) for i, t in enumerate(tensors)]
    return submit(combine(name or "grouped_allgather", name, parts), "allgather")


# ----------------------------------------------------------------------------- broadcast

def _broadcast_async(tensor: torch.Tensor, output: torch.Tensor, root_rank: int, name: str | None,
                     process_set: ProcessSet) -> int:
    resolve(process_set)
    if process_set.ranks and root_rank not in process_set.ranks:
        raise ValueError(f"root_rank={root_rank} is not in {process_set}")

    def launch(pending: Pending) -> None:
        announce(pending, stall.BROADCAST, [tensor], process_set, extra=root_rank)
        if output is not tensor:
            with torch.no_grad():
                output.copy_(tensor)
        pending.works.append(transport.broadcast(output, root_rank, pending.group))

    return submit(Pending(label=name or "broadcast", name=name, launch=launch, finish=lambda: output), "broadcast")


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start broadcasting ``tensor`` from global rank ``root_rank``; the input is not modified."""
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _broadcast_async(tensor.detach(), output, root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place `broadcast_async`."""
    contiguous(tensor)
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


# ----------------------------------------------------------------------------- barrier

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every process of ``process_set`` reaches the barrier (queued async ops stay queued)."""
    if runtime().settings.metadata_check:
        announce(Pending(label="barrier"), stall.BARRIER, [], process_set, needed=True)
        return
    group, _, _ = resolve(process_set)
    seq = stall.next_seq(process_set.process_set_id)
    stall.wait(dist.barrier(group=group, async_op=True), "barrier", process_set.process_set_id, seq, group)


__all__ = [
    "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather_async",
    "grouped_allgather_async", "broadcast_async", "broadcast_async_", "barrier", "poll", "synchronize",
]
