"""``hvd.join()``: a rank out of data keeps serving the others' allreduces with zeros.

A joined rank loops on the metadata exchange (see `stall`): while other ranks still
submit allreduces (plain, grouped, or a DistributedOptimizer step) it contributes zeros
of the announced size; once every rank's record says JOIN, all return the rank that
joined last. Like Horovod, averages still divide by the full size, and allgather,
broadcast, alltoall and reducescatter are refused while a rank has joined: the ranks that
called them get the error, the joined rank keeps waiting. Ops this rank queued and has not
launched yet (see `pending`) launch before it joins. Join needs the
metadata exchange, so with ``POLYTRAIN_HOROVOD_METADATA_CHECK=0`` it only waits for
every rank to join.
"""

from __future__ import annotations

import torch

from polytrain.horovod.common import HorovodInternalError, Sum
from polytrain.horovod.torch import speculate, stall, transport
from polytrain.horovod.torch.pending import flush
from polytrain.horovod.torch.process_sets import global_process_set
from polytrain.horovod.torch.runtime import runtime

#: Gradient bucket layouts of live DistributedOptimizers: layout id -> [(elements, dtype)].
OPTIMIZER_LAYOUTS: dict[int, list[tuple[int, torch.dtype]]] = {}

_joins = 0


def join(device: int = -1) -> int:
    """Mark this rank done; returns the global rank that joined last."""
    global _joins
    state = runtime()
    flush()
    size = state.topology.size
    _joins += 1
    arrivals = state.store.add(f"join/{_joins}", 1)
    last = arrivals == size
    if not state.settings.metadata_check:
        if last:
            state.store.set(f"join/{_joins}/last", str(state.topology.rank))
        return int(state.store.get(f"join/{_joins}/last").decode())
    while True:
        seq = stall.next_seq(0)
        speculate.slot(0, None, None, size, "join", seq)  # a joined rank never sends a predicted op's data
        work, records = stall.start_exchange(stall.make_record(stall.JOIN, None, [], extra=int(last)), None, size)
        stall.wait(work, "join", 0, seq, None)
        speculate.learn(0, records)
        if bool((records[:, stall.KIND] == stall.JOIN).all()):
            return int((records[:, stall.EXTRA] == 1).nonzero()[0, 0])
        active = records[records[:, stall.KIND] != stall.JOIN]
        if int(active[0, stall.KIND]) not in (stall.ALLREDUCE, stall.GROUPED_ALLREDUCE, stall.OPTIMIZER) or \
                not stall.agree(records):
            continue  # the active ranks refuse this op themselves (see stall.verify); keep waiting
        _serve(active[0], seq)


def _serve(record: torch.Tensor, seq: int) -> None:
    """Take part with zeros in the allreduce(s) the other ranks announced in ``record``."""
    kind = int(record[stall.KIND])
    if kind == stall.OPTIMIZER:
        layout = OPTIMIZER_LAYOUTS.get(int(record[stall.EXTRA]))
        if layout is None:
            raise HorovodInternalError("a DistributedOptimizer step reached a joined rank that has no "
                                              "optimizer with the same parameters")
        op = Sum
        buffers = [torch.zeros(numel, dtype=dtype) for numel, dtype in layout]  # each with its spare flag element
    else:
        code = int(record[stall.DTYPE])
        if not 0 < code <= len(stall.DTYPES):
            raise HorovodInternalError("a grouped allreduce of mixed dtypes cannot be joined")
        op = int(record[stall.EXTRA])
        buffers = [torch.zeros(int(record[stall.NUMEL]), dtype=stall.dtype_of(code))]
    works = [transport.all_reduce(b, op) for b in buffers]
    for work in works:
        stall.wait(work, "join", global_process_set.process_set_id, seq, None)
