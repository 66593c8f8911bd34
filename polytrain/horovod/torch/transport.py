"""Where the shim's data moves: MPI when an MPI launcher started the job, gloo otherwise.

Under ``mpirun``/``horovodrun --mpi``/``srun`` real Horovod runs its CPU collectives on
MPI (``HOROVOD_CPU_OPERATIONS=mpi``), and so does the shim: MPI's shared-memory transport
moves a 16 MiB allreduce several times faster than gloo over loopback TCP. The MPI calls
run on one background thread (like Horovod's), in submission order, on a duplicate of the
world communicator, so the caller gets an asynchronous work object just as from
``torch.distributed``; mpi4py releases the GIL inside MPI, so backward goes on meanwhile.

MPI carries what it can: CPU tensors of the global process set in dtypes MPI reduces
natively, and that set's metadata records (a non-blocking allgather on a second
communicator, polled by the calling thread). Everything else (CUDA tensors — NCCL —,
float16/bfloat16, process sets, alltoall, reducescatter) stays on torch.distributed. The
choice depends only on what every rank announced alike (the metadata check makes sure of
that), so all ranks pick the same channel for each op.

``HOROVOD_CPU_OPERATIONS=gloo`` keeps everything on gloo; ``=mpi`` insists on MPI.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polytrain.horovod.common import Average, Max, Min, Product, Sum
from polytrain.horovod.torch import basics

TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
#: dtypes MPI reduces natively (its C types); others stay on gloo
MPI_DTYPES = frozenset({torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
                        torch.int64})


class MpiWork:
    """A submitted MPI collective, with the parts of ``torch.distributed.Work`` the shim uses."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"MPI collective timed out after {timeout}")
        if self._error is not None:
            raise RuntimeError(f"MPI collective failed: {self._error}") from self._error
        return True


class MpiRequest:
    """A non-blocking MPI call the calling thread polls (with short sleeps, so a rank waiting
    for slower ones does not spin a core); a Work like `MpiWork`."""

    def __init__(self, request: Any, *keep: Any) -> None:
        self._request = request
        self._keep = keep
        self._done = False

    def is_completed(self) -> bool:
        self._done = self._done or bool(self._request.Test())
        return self._done

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        spins, pause = 0, 0.0
        while not self.is_completed():
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"MPI collective timed out after {timeout}")
            spins += 1
            if spins > 200:  # the peers are not there yet: back off to at most 1 ms between tests
                time.sleep(pause)
                pause = min(pause + 5e-5, 1e-3)
        return True


class MpiEngine:
    """One thread that runs MPI collectives in the order they were submitted.

    Metadata records go on a second communicator, from the calling thread (`exchange`).
    """

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm.Dup()  # collective: every rank builds its engine at hvd.init()
        self.meta_comm = comm.Dup()
        self.size = self.comm.Get_size()
        self._ops = {Average: MPI.SUM, Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="polytrain-horovod-mpi", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, work, _keep = item
            try:
                call()
            except BaseException as exc:  # reported to whoever waits on the work
                work._error = exc
            finally:
                work._done.set()
                del item, call, work, _keep  # free the tensors now, not when the next op arrives

    def _submit(self, call: Callable[[], Any], *keep: torch.Tensor) -> MpiWork:
        work = MpiWork()
        self._queue.put((call, work, keep))  # ``keep`` holds the tensors until MPI is done with them
        return work

    def carries(self, *tensors: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" and t.dtype in MPI_DTYPES and t.is_contiguous() for t in tensors)

    def all_reduce(self, tensor: torch.Tensor, op: int) -> MpiWork:
        buf, mpi_op = tensor.detach().numpy(), self._ops[op]
        return self._submit(lambda: self.comm.Allreduce(self._mpi.IN_PLACE, buf, op=mpi_op), tensor)

    def broadcast(self, tensor: torch.Tensor, root: int) -> MpiWork:
        buf = tensor.detach().numpy()
        return self._submit(lambda: self.comm.Bcast(buf, root=root), tensor)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> MpiWork:
        send, recv = tensor.detach().numpy(), output.detach().numpy()
        return self._submit(lambda: self.comm.Allgather(send, recv), output, tensor)

    def exchange(self, record: torch.Tensor) -> tuple[MpiRequest, torch.Tensor]:
        """Start gathering every rank's int64 ``record``; returns (work, gathered[size, len])."""
        send = record.numpy()
        table = torch.empty((self.size, record.numel()), dtype=torch.int64)
        return MpiRequest(self.meta_comm.Iallgather(send, table.numpy()), send), table

    def close(self) -> None:
        """Stop the thread once it has run everything submitted."""
        self._queue.put(None)
        self._thread.join(timeout=10)


def open_engine(env: Mapping[str, str], world_size: int) -> MpiEngine | None:
    """The MPI engine for this job, or None to move everything with torch.distributed.

    Raises ValueError when ``HOROVOD_CPU_OPERATIONS`` asks for MPI that cannot be had.
    """
    choice = env.get("HOROVOD_CPU_OPERATIONS", "").strip().lower()
    if choice not in ("", "mpi", "gloo"):
        raise ValueError(f"HOROVOD_CPU_OPERATIONS={env['HOROVOD_CPU_OPERATIONS']!r}: polytrain's Horovod shim "
                         "supports 'mpi' or 'gloo'")
    if choice == "gloo" or world_size == 1:
        return None
    from polytrain.environments import environment_for

    if choice == "" and not environment_for(dict(env)).speaks_mpi:
        return None
    why = _mpi_unusable(world_size)
    if why is None:
        from mpi4py import MPI

        return MpiEngine(MPI.COMM_WORLD)
    if choice == "mpi":
        raise ValueError(f"HOROVOD_CPU_OPERATIONS=mpi, but {why}; unset it (or set gloo) to use gloo")
    return None


def _mpi_unusable(world_size: int) -> str | None:
    try:
        from mpi4py import MPI
    except ImportError:
        return "mpi4py is not installed"
    if MPI.COMM_WORLD.Get_size() != world_size:
        return f"MPI sees {MPI.COMM_WORLD.Get_size()} processes, the launcher started {world_size}"
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return "MPI was initialised without MPI_THREAD_MULTIPLE"
    return None


# ----------------------------------------------------------------------------- dispatch

def _engine_for(group: Any, *tensors: torch.Tensor) -> MpiEngine | None:
    engine = basics.runtime().mpi
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
