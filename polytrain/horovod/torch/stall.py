"""Mismatch and stall detection: no silent hang, no silent corruption.

Before a collective's data moves, every rank contributes a fixed-size record (what op,
the name's hash, dtype, shape, root or reduce op) to one small all-gather. All ranks see
the same records, so a mismatch raises `CollectiveMismatchError` on every rank, naming
what each rank called. The records also carry what allgather/alltoall need anyway (each
rank's first dimension, the splits). ``POLYTRAIN_HOROVOD_METADATA_CHECK=0`` turns the
check off for ops that do not need the exchange (allreduce, broadcast, reducescatter,
barrier, the optimizer's per-step record). An op every rank can predict skips the exchange (`speculate`).

Waits are monitored: a collective still incomplete after ``HOROVOD_STALL_CHECK_TIME_SECONDS``
prints Horovod's stall warning naming the tensor and the ranks that have not submitted it
(found through the rendezvous store, which stays reachable while gloo is blocked), and
after ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (when set) raises HorovodInternalError.
"""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polytrain.horovod.common import HorovodInternalError, stall_message
from polytrain.horovod.torch.runtime import Runtime, is_initialized, mark_broken, runtime

RECORD = 16
ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN, GROUPED_ALLREDUCE, OPTIMIZER = range(1, 10)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast", ALLTOALL: "alltoall",
              REDUCESCATTER: "reducescatter", BARRIER: "barrier", JOIN: "join",
              GROUPED_ALLREDUCE: "grouped_allreduce", OPTIMIZER: "DistributedOptimizer gradient allreduce"}
# Record fields
KIND, NAME, DTYPE, SHAPE, NUMEL, EXTRA, COUNT, DIM0, NDIM = range(9)
DIMS = 9  # fields 9..15 hold the first 7 dimensions (messages, join's zero tensors)
_COMPARED_UNEVEN = (KIND, NAME, DTYPE, SHAPE, EXTRA, COUNT, NDIM)
_COMPARED = _COMPARED_UNEVEN + (NUMEL,)

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool)
_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(DTYPES)}


class CollectiveMismatchError(HorovodInternalError):
    """Ranks called different collectives, or the same one on different tensors."""


def crc(text: str) -> int:
    return zlib.crc32(text.encode())


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, 1000 + crc(str(dtype)) % 1000)


def dtype_of(code: int) -> torch.dtype:
    return DTYPES[code - 1]


def make_record(kind: int, name: str | None, tensors: Sequence[torch.Tensor], extra: int = 0,
                uneven: bool = False) -> torch.Tensor:
    """This rank's record; with ``uneven`` the first dimension may differ across ranks."""
    return torch.tensor(record_values(kind, name, tensors, extra, uneven), dtype=torch.int64)


def record_row(kind: int, name: str | None, tensors: Sequence[torch.Tensor], extra: int = 0,
               uneven: bool = False) -> tuple[int, ...]:
    """`record_values` as a tuple; a one-tensor op's row is remembered by what it is made of (an op repeated every
    step costs a lookup)."""
    if len(tensors) != 1:
        return tuple(record_values(kind, name, tensors, extra, uneven))
    key = (kind, name, extra, uneven, tensors[0].shape, tensors[0].dtype)
    row = _ROWS.get(key)
    if row is None:
        if len(_ROWS) >= _ROWS_LIMIT:
            _ROWS.clear()
        row = _ROWS[key] = tuple(record_values(kind, name, tensors, extra, uneven))
    return row


#: `record_row`'s one-tensor rows, and how many it keeps before it starts over
_ROWS: dict[tuple[Any, ...], tuple[int, ...]] = {}
_ROWS_LIMIT = 4096


def record_values(kind: int, name: str | None, tensors: Sequence[torch.Tensor], extra: int = 0,
                  uneven: bool = False) -> list[int]:
    """`make_record`'s fields, as Python ints."""
    record = [0] * RECORD
    record[KIND], record[NAME], record[EXTRA], record[COUNT] = kind, crc(name or ""), extra, len(tensors)
    if len(tensors) == 1:
        shape = tuple(tensors[0].shape)
        record[DTYPE] = dtype_code(tensors[0].dtype)
        record[SHAPE] = crc(str(shape[1:] if uneven else shape))
        record[NUMEL] = tensors[0].numel()
        record[DIM0] = shape[0] if shape else 1
        record[NDIM] = len(shape)
        record[DIMS:DIMS + min(len(shape), RECORD - DIMS)] = shape[:RECORD - DIMS]
    elif tensors:
        dtypes = {t.dtype for t in tensors}
        record[DTYPE] = dtype_code(next(iter(dtypes))) if len(dtypes) == 1 else -crc(str(sorted(map(str, dtypes))))
        record[SHAPE] = crc(str([tuple(t.shape) for t in tensors]))
        record[NUMEL] = sum(t.numel() for t in tensors)
    return record


def describe(record: Sequence[int], name: str | None) -> str:
    kind = KIND_NAMES.get(int(record[KIND]), f"op {int(record[KIND])}")
    if kind == "join" or kind == "barrier":
        return kind
    if int(record[COUNT]) == 1:
        dims = [int(d) for d in record[DIMS:DIMS + min(int(record[NDIM]), RECORD - DIMS)]]
        code = int(record[DTYPE])
        dtype = str(dtype_of(code)).replace("torch.", "") if 0 < code <= len(DTYPES) else "?"
        shape = f"{dtype}{dims}"
    else:
        shape = f"{int(record[COUNT])} tensors, {int(record[NUMEL])} elements"
    extra = f", root_rank={int(record[EXTRA])}" if kind == "broadcast" else ""
    return f"{kind}({name or 'unnamed'!r}: {shape}{extra})"


# ----------------------------------------------------------------------------- exchange

def start_exchange(record: torch.Tensor, group: Any, size: int) -> tuple[Any, torch.Tensor]:
    """Launch the all-gather of ``record`` (over MPI when the shim moves data there: see `mpi`);
    returns (work, gathered[size, len])."""
    if size == 1:
        return None, record.clone().view(1, -1)
    engine = runtime().mpi
    if engine is not None and group is None:
        return engine.exchange(record)
    gathered = torch.empty(size * record.numel(), dtype=torch.int64)
    work = dist.all_gather_single(gathered, record, group=group, async_op=True)
    return work, gathered.view(size, -1)


def verify(records: torch.Tensor, name: str | None, group: Any, process_set_id: int, seq: int,
           uneven: bool = False, joined_ok: bool = False) -> None:
    """Raise CollectiveMismatchError on every rank when the records disagree.

    Every rank holds the same records, so every rank raises (or not) alike and no data has
    moved: the ranks stay in step and the next collective works (see `pending`). With
    ``joined_ok`` a JOIN record (a rank inside ``hvd.join()``) matches any allreduce; other
    ops are refused while a rank has joined (the joined rank keeps waiting in ``join``).
    """
    rows = records
    joined = rows[:, KIND] == JOIN
    if bool(joined.any()) and not bool(joined.all()):
        active = rows[~joined]
        if not joined_ok:
            kind = KIND_NAMES.get(int(active[0, KIND]), "this op")
            raise CollectiveMismatchError(f"{kind.capitalize()} is not supported with Join at this time.")
        rows = active
    fields = list(_COMPARED_UNEVEN if uneven else _COMPARED)
    if bool((rows[:, fields] == rows[0, fields]).all()):
        return
    try:
        who = _who_called_what(records, name, group, process_set_id, seq)
    except RuntimeError:  # the store is gone too: describe from the records alone
        members = _members(group, len(records))
        who = "; ".join(f"rank {rank} called {describe(records[i].tolist(), None)}" for i, rank in enumerate(members))
    raise CollectiveMismatchError("Mismatched collective calls across ranks: " + who)


def agree(records: torch.Tensor, uneven: bool = False) -> bool:
    """Whether the records of the ranks not inside ``join`` describe one op (no raising, no store)."""
    rows = records[records[:, KIND] != JOIN]
    fields = list(_COMPARED_UNEVEN if uneven else _COMPARED)
    return len(rows) == 0 or bool((rows[:, fields] == rows[0, fields]).all())


def _who_called_what(records: torch.Tensor, name: str | None, group: Any, process_set_id: int, seq: int) -> str:
    """Every rank's call, in words, swapped through the store (gloo may be out of step by now)."""
    state = runtime()
    members = _members(group, len(records))
    me = members.index(state.topology.rank)
    prefix = f"mismatch/{process_set_id}/{seq}/"
    state.store.set(prefix + str(state.topology.rank), describe(records[me].tolist(), name))
    by_call: dict[str, list[int]] = {}
    for index, rank in enumerate(members):
        try:
            state.store.wait([prefix + str(rank)], timedelta(seconds=5))
            text = state.store.get(prefix + str(rank)).decode()
        except RuntimeError:  # that rank has not looked at the records yet
            text = describe(records[index].tolist(), "?")
        by_call.setdefault(text, []).append(rank)
    # Global rank 0 may host the store: it leaves (taking the store down) only once all have read.
    try:
        arrived = state.store.add(prefix + "read", 1)
        deadline = time.monotonic() + 5
        while state.topology.rank == 0 and arrived < len(members) and time.monotonic() < deadline:
            time.sleep(0.01)
            arrived = state.store.add(prefix + "read", 0)
    except RuntimeError:
        pass
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))} called {text}"
                     for text, ranks in by_call.items())


def _members(group: Any, size: int) -> list[int]:
    if group is None:
        return list(range(size))
    return dist.get_process_group_ranks(group)


# ----------------------------------------------------------------------------- monitored waits

def next_seq(process_set_id: int) -> int:
    state = runtime()
    state.submitted[process_set_id] = state.submitted.get(process_set_id, 0) + 1
    return state.submitted[process_set_id]


def wait(work: Any, label: str, process_set_id: int, seq: int, group: Any) -> None:
    """Wait for ``work``, warning about and eventually shutting down on a stall."""
    if work is None:
        return
    state = runtime()
    settings = state.settings
    if not settings.stall_check:
        work.wait()
        return
    if _wait_for(work, settings.stall_check_seconds):
        return
    started = time.monotonic() - settings.stall_check_seconds
    missing = _missing_ranks(state, label, process_set_id, seq, group)
    _log("WARNING", stall_message({r: [label] for r in missing}, settings.stall_check_seconds))
    shutdown_after = settings.shutdown_after
    if shutdown_after is None:
        work.wait()
        return
    if _wait_for(work, max(0.0, shutdown_after - (time.monotonic() - started))):
        return
    missing = _missing_ranks(state, label, process_set_id, seq, group)
    _log("ERROR", stall_message({r: [label] for r in missing}, shutdown_after, shutdown=True))
    mark_broken()
    raise HorovodInternalError(f"{label} stalled for more than {shutdown_after:.0f} seconds "
                                      f"(missing ranks {missing}); Horovod is shutting down")


def _wait_for(work: Any, seconds: float) -> bool:
    if seconds <= 0.001:  # a zero timeout means "no timeout" to torch.distributed
        return bool(work.is_completed())
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError as exc:
        if "timed out" in str(exc).lower():
            return False
        raise HorovodInternalError(str(exc).splitlines()[0]) from exc
    return True


def _missing_ranks(state: Runtime, label: str, process_set_id: int, seq: int, group: Any) -> list[int]:
    """Global ranks of the set that have not submitted collective number ``seq`` (per the store)."""
    members = _members(group, state.topology.size)
    store = state.store
    me = state.topology.rank
    store.set(f"stall/{process_set_id}/{me}", f"{state.submitted.get(process_set_id, 0)}\t{label}")
    deadline = time.monotonic() + min(1.0, state.settings.stall_check_seconds / 2)
    missing = members
    while time.monotonic() < deadline:
        missing = []
        for rank in members:
            key = f"stall/{process_set_id}/{rank}"
            if rank == me or (store.check([key]) and int(store.get(key).decode().split("\t")[0]) >= seq):
                continue
            missing.append(rank)
        if not missing:
            break
        time.sleep(0.2)
    return missing


def _log(level: str, message: str) -> None:
    who = runtime().topology.rank if is_initialized() else "?"
    sys.stderr.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] [rank {who}] [{level}] {message}\n")
    sys.stderr.flush()
