"""Skipping the metadata exchange of an op every rank can predict (the shim's form of Horovod's response cache).

Horovod negotiates a tensor once and then serves repeated collectives from its response cache. The shim's
collectives run in order, so here the cache predicts the *next* op: every rank learns, per process set, which
agreed op followed the last `CONTEXT` agreed ops, from the records all ranks exchanged (`stall`) — so every rank
learns the same thing and makes the same prediction. When there is a prediction, every rank runs the predicted
op's allreduce(s), shaped alike on every rank, in place of the exchange: a rank whose op is the predicted one
sends its data, with a flag saying so in a spare last element; any other rank (another op, another shape or
name, a rank inside ``hvd.join()``) sends zeros with the flag saying not. The flag is reduced with the data, so
every rank reaches the same verdict:

* every rank sent the predicted op: the reduced buffers are the op's result, and no exchange ran;
* not: every rank goes on to the full exchange, which names a mismatch on every rank as it always did (and the
  op's data moves again).

Gloo and MPI never see buffers of different sizes, since every rank shapes the predicted allreduces from the
shared prediction. A miss costs the predicted allreduces; the history then learns the new successor.

Predicted: small allreduces (plain or grouped, one dtype, up to `SMALL_BYTES`; larger ones keep the exchange,
cheap beside their transfer, and launch asynchronously), which wait for the verdict at launch — on MPI their
allreduce runs from the calling thread, on the records' communicator (`transport.all_reduce_now`): handing a
4 KiB op to the engine's thread and waiting for it cost more than the op; and a
DistributedOptimizer's step, whose gradient buckets then launch during backward without waiting for any
exchange, the verdict read from the first bucket before the step uses them (`expect`, `defer`, `settle`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from polytrain.horovod.common import Average, Max, Min, Product, Sum
from polytrain.horovod.torch import stall, transport
from polytrain.horovod.torch.runtime import runtime

#: the largest allreduce (bytes) whose exchange is predicted away
SMALL_BYTES = 256 * 1024
#: dtypes whose flag values (0, 1, the set's size) are exact
_FLAG_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
#: (this rank sent the predicted op, it did not), by reduce op
_FLAGS = {Sum: (1, 0), Average: (1, 0), Min: (1, 0), Product: (1, 0), Max: (0, 1)}
#: successors remembered per process set; the table starts over beyond this (every rank alike)
_LIMIT = 4096
#: how many agreed ops before an op predict it (three tell apart e.g. two allreduces of one name, then a step)
CONTEXT = 3

Row = tuple[int, ...]
#: the buffers of a predicted op: (elements, the spare flag element included; dtype; device) each
Pieces = tuple[tuple[int, torch.dtype, torch.device], ...]


@dataclass
class _Successor:
    record: Row
    op: int
    pieces: Pieces

    @property
    def eager(self) -> bool:
        """Launched and waited for at once (a small allreduce, `slot`): its allreduce, and every rank's zeros in its
        place, go by `transport.all_reduce_now`; else (a DistributedOptimizer's buckets) by `transport.all_reduce`."""
        return self.record[stall.KIND] in (stall.ALLREDUCE, stall.GROUPED_ALLREDUCE)


@dataclass
class _History:
    """One process set's agreed ops: the last `CONTEXT` ones, and which op followed which of them."""

    recent: tuple[Row, ...] = ()
    next: dict[tuple[Row, ...], _Successor | None] = field(default_factory=dict)
    #: a speculatively launched op whose verdict is not read yet: read before the set's next op
    unresolved: Callable[[], None] | None = None
    hits: int = 0  # predicted ops every rank sent: no exchange ran
    misses: int = 0  # predicted ops some rank did not send: the exchange ran after the predicted allreduce(s)

    def agreed(self, row: Row) -> None:
        self.recent = (*self.recent, row)[-CONTEXT:]


@dataclass
class Hit:
    """Every rank sent the predicted op: ``data`` holds its reduced values (flattened, not yet post-scaled)."""

    data: torch.Tensor


def _history(set_id: int) -> _History:
    return runtime().speculation.setdefault(set_id, _History())


def allreduce_pieces(row: Row, device: torch.device) -> Pieces | None:
    """The one buffer of a small allreduce's prediction (None for ops never predicted at launch)."""
    code = row[stall.DTYPE]
    if row[stall.KIND] not in (stall.ALLREDUCE, stall.GROUPED_ALLREDUCE) or not 0 < code <= len(stall.DTYPES):
        return None
    dtype = stall.dtype_of(code)
    nbytes = row[stall.NUMEL] * torch.empty(0, dtype=dtype).element_size()
    if not 0 < nbytes <= SMALL_BYTES:
        return None
    return ((row[stall.NUMEL] + 1, dtype, device),)


def learn(set_id: int, records: torch.Tensor, op: int | None = None, pieces: Pieces | None = None) -> None:
    """After an exchange of set ``set_id`` (every member took part): remember its op as the successor of the ones
    before, when every rank's record is the same; ``op``/``pieces``: how it would be predicted (None: never).
    Any disagreement (a mismatch, a rank inside join) leaves no op to predict from."""
    history = _history(set_id)
    if not bool((records == records[0]).all()):
        history.recent = ()
        return
    row = row_of(records[0])
    if history.recent:
        if len(history.next) >= _LIMIT:
            history.next.clear()
        usable = op in _FLAGS and pieces and pieces[0][1] in _FLAG_DTYPES
        history.next[history.recent] = _Successor(row, op, pieces) if usable else None
    history.agreed(row)


def _predicted(set_id: int, size: int) -> tuple[_History, _Successor | None]:
    history = _history(set_id)
    if history.unresolved is not None:  # the op before has to be settled first, on every rank alike
        settle, history.unresolved = history.unresolved, None
        settle()
    if size == 1 or not runtime().settings.metadata_check or not history.recent:
        return history, None
    return history, history.next.get(history.recent)


def row_of(record: torch.Tensor) -> Row:
    """A metadata record as a hashable row."""
    return tuple(int(v) for v in record.tolist())


def _decoy(successor: _Successor, group: Any) -> list[Any]:
    """Zeros in the predicted op's shape, flagged as not sent; the started works."""
    works = []
    reduce = transport.all_reduce_now if successor.eager else transport.all_reduce
    for index, (numel, dtype, device) in enumerate(successor.pieces):
        buffer = torch.zeros(numel, dtype=dtype, device=device)
        if index == 0:
            buffer[-1] = _FLAGS[successor.op][1]
        works.append(reduce(buffer, successor.op, group))
    return works


def verdict(set_id: int, successor_row: Row, op: int, flag: float, size: int) -> bool:
    """Whether every rank sent the predicted op, from the reduced flag; counted, and remembered as agreed."""
    history = _history(set_id)
    sent = _FLAGS[op][0]
    if not (flag == size if op in (Sum, Average) else flag == sent):
        history.misses += 1
        return False
    history.hits += 1
    history.agreed(successor_row)
    return True


def slot(set_id: int, record: Row | None, group: Any, size: int, label: str, seq: int,
         payload: Callable[[int], torch.Tensor] | None = None) -> Hit | None:
    """This op's place in the sequence, when the ops before it predict one: the predicted allreduce(s), run by every
    rank, waited for. ``record``/``payload``: this rank's record and a maker of its flattened data with the flag
    appended (None for an op that is not predicted at launch: join, a barrier, ...). Returns `Hit` when every rank
    sent the predicted op; None when nothing was predicted or some rank sent something else (the caller exchanges
    records next)."""
    history, successor = _predicted(set_id, size)
    if successor is None:
        return None
    if payload is not None and successor.eager and record == successor.record:
        buffer = payload(flag(successor.op))
        works = [transport.all_reduce_now(buffer, successor.op, group)]
    else:
        buffer, works = None, _decoy(successor, group)
    for work in works:
        stall.wait(work, label, set_id, seq, group)
    if buffer is None:  # this rank sent zeros: not every rank sent the op
        history.misses += 1
        return None
    return Hit(buffer[:-1]) if verdict(set_id, successor.record, successor.op, buffer[-1].item(), size) else None


def expect(set_id: int, record: torch.Tensor, pieces: Pieces, group: Any, size: int, label: str, seq: int) -> bool:
    """An op that launches its own buffers without waiting (a DistributedOptimizer step): True when it is the
    predicted one — then it sends its buffers, the first one's spare last element set to `flag` — else the
    predicted allreduces (if any) run here as zeros, and False: the caller exchanges records."""
    _, successor = _predicted(set_id, size)
    if successor is None:
        return False
    if successor.pieces == pieces and row_of(record) == successor.record:
        return True
    for work in _decoy(successor, group):
        stall.wait(work, label, set_id, seq, group)
    _history(set_id).misses += 1
    return False


def flag(op: int) -> int:
    """The value a rank that sends the predicted op puts in its first buffer's spare last element."""
    return _FLAGS[op][0]


def defer(set_id: int, settle: Callable[[], None]) -> None:
    """``settle`` reads a speculatively launched op's verdict (and falls back on a miss) before the set's next op."""
    _history(set_id).unresolved = settle


def settle(set_id: int) -> None:
    """Read the verdict of the set's speculatively launched op now, if any is pending."""
    _predicted(set_id, 1)


def counts(set_id: int = 0) -> tuple[int, int]:
    """(hits, misses) of predicted ops in process set ``set_id`` since ``hvd.init()``."""
    history = _history(set_id)
    return history.hits, history.misses
