"""Horovod's ``ProcessSet`` surface for the shim, which runs every collective on all ranks."""

from __future__ import annotations

from collections.abc import Sequence

from polytrain.horovod.common import HorovodUnsupportedError, Topology

_ONLY_GLOBAL = ("polytrain's Horovod shim supports only the global process set; install Horovod with "
                "TensorFlow support for process sets")


class ProcessSet:
    """A set of ranks collectives run on; the shim knows only ``global_process_set``."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Sequence[int] | object) -> None:
        if hasattr(ranks_or_comm, "Get_rank"):
            self.mpi_comm = ranks_or_comm
        else:
            self.ranks = sorted(int(r) for r in ranks_or_comm)  # type: ignore[union-attr]

    def size(self) -> int | None:
        return _topology.size if self.process_set_id == 0 and _topology is not None else None

    def rank(self) -> int | None:
        return _topology.rank if self.process_set_id == 0 and _topology is not None else None

    def included(self) -> bool | None:
        return None if self.process_set_id is None else True

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_topology: Topology | None = None


def register_global(topology: Topology | None) -> None:
    """Make the global set span the job ``hvd.init()`` started (None: ``hvd.shutdown()`` ended it)."""
    global _topology
    _topology = topology
    if topology is not None:
        global_process_set.ranks = list(range(topology.size))


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    raise HorovodUnsupportedError(_ONLY_GLOBAL)


def remove_process_set(process_set: ProcessSet) -> bool:
    raise HorovodUnsupportedError(_ONLY_GLOBAL)


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
