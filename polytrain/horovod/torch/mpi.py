"""The shim's MPI channel: when an MPI launcher started the job, CPU tensors move over MPI.

Under ``mpirun``/``horovodrun --mpi``/``srun`` real Horovod runs its CPU collectives on
MPI (``HOROVOD_CPU_OPERATIONS=mpi``), and so does the shim: MPI's shared-memory transport
moves a 16 MiB allreduce several times faster than gloo over loopback TCP. The MPI calls
run on one background thread (like Horovod's), in submission order, on a duplicate of the
world communicator (`polytrain.comm.mpi_transport.MpiTransport`), so the caller gets an
asynchronous work object just as from ``torch.distributed``; mpi4py releases the GIL
inside MPI, so backward goes on meanwhile.

MPI carries what it can: CPU tensors of the global process set in dtypes MPI reduces
natively, and that set's metadata records (a non-blocking allgather on a second
communicator, polled by the calling thread). Everything else (CUDA tensors — NCCL —,
float16/bfloat16, process sets, alltoall, reducescatter) stays on torch.distributed. The
choice depends only on what every rank announced alike (the metadata check makes sure of
that), so all ranks pick the same channel for each op (see `transport`).

``HOROVOD_CPU_OPERATIONS=gloo`` keeps everything on gloo; ``=mpi`` insists on MPI.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from polytrain.comm.mpi_transport import REDUCIBLE, MpiTransport, wait
from polytrain.horovod.common import REDUCTIONS
from polytrain.horovod.torch.stall import DTYPES

#: the shim's dtypes that MPI reduces natively; others stay on gloo
MPI_DTYPES = frozenset(d for d in DTYPES if str(d).removeprefix("torch.") in REDUCIBLE)
#: tests of a pending record exchange before the calling thread starts sleeping between tests
_SPINS = 200
#: tests of a small allreduce run from the calling thread before sleeping: it completes within microseconds of the
#: last rank's arrival, and a sleep (50 us and up) would cost more than the whole op
_EAGER_SPINS = 20_000


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
    """A non-blocking MPI call the calling thread polls (`polytrain.comm.mpi_transport.wait`); a Work like `MpiWork`."""

    def __init__(self, request: Any, *keep: Any, spins: int = _SPINS) -> None:
        self._request = request
        self._keep = keep
        self._done = False
        self._spins = spins

    def is_completed(self) -> bool:
        self._done = self._done or bool(self._request.Test())
        return self._done

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        seconds = None if timeout is None else timeout.total_seconds()
        if not wait(self._request, spins=self._spins, timeout=seconds):
            raise RuntimeError(f"MPI collective timed out after {timeout}")
        self._done = True
        return True


class MpiEngine:
    """One thread that runs MPI collectives in the order they were submitted.

    Metadata records go on a second communicator, from the calling thread (`exchange`), and so do the
    small allreduces that take the place of an exchange (`all_reduce_now`, see `speculate`).
    """

    def __init__(self, comm: Any = None) -> None:
        # duplicating is collective: every rank builds its engine at hvd.init()
        self.data = MpiTransport(comm, duplicate=True)
        self.meta = MpiTransport(comm, duplicate=True)
        self.size = self.data.size
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
        buf, reduction = tensor.detach().numpy(), REDUCTIONS[op]
        return self._submit(lambda: self.data.allreduce(buf, reduction), tensor)

    def broadcast(self, tensor: torch.Tensor, root: int) -> MpiWork:
        buf = tensor.detach().numpy()
        return self._submit(lambda: self.data.bcast(buf, root), tensor)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> MpiWork:
        send, recv = tensor.detach().numpy(), output.detach().numpy()
        return self._submit(lambda: self.data.allgather(send, recv), output, tensor)

    def all_reduce_now(self, tensor: torch.Tensor, op: int) -> MpiRequest:
        """Start reducing a small ``tensor`` from the calling thread, on the records' communicator: no hand-over to
        the engine's thread, whose queue may hold large ops still in flight."""
        buf = tensor.detach().numpy()
        return MpiRequest(self.meta.start_allreduce(buf, REDUCTIONS[op]), buf, tensor, spins=_EAGER_SPINS)

    def exchange(self, record: torch.Tensor) -> tuple[MpiRequest, torch.Tensor]:
        """Start gathering every rank's int64 ``record``; returns (work, gathered[size, len])."""
        send = record.numpy()
        table = torch.empty((self.size, record.numel()), dtype=torch.int64)
        return MpiRequest(self.meta.start_allgather(send, table.numpy()), send), table

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
    try:
        world = MpiTransport()
    except ImportError:
        why: str | None = "mpi4py is not installed"
    else:
        why = _unusable(world, world_size)
        if why is None:
            return MpiEngine(world.comm)
    if choice == "mpi":
        raise ValueError(f"HOROVOD_CPU_OPERATIONS=mpi, but {why}; unset it (or set gloo) to use gloo")
    return None


def _unusable(world: MpiTransport, world_size: int) -> str | None:
    if world.size != world_size:
        return f"MPI sees {world.size} processes, the launcher started {world_size}"
    if not world.thread_multiple():
        return "MPI was initialised without MPI_THREAD_MULTIPLE"
    return None
