"""Horovod's ``ProcessSet`` surface for the shim, which runs every collective on all ranks."""

from __future__ import annotations

from collections.abc import Sequence

from polytrain.horovod.tensorflow._errors import HorovodUnsupportedError

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
        from polytrain.horovod.tensorflow import _shim

        return _shim.size() if self.process_set_id == 0 and _shim.is_initialized() else None

    def rank(self) -> int | None:
        from polytrain.horovod.tensorflow import _shim

        return _shim.rank() if self.process_set_id == 0 and _shim.is_initialized() else None

    def included(self) -> bool | None:
        return None if self.process_set_id is None else True

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    raise HorovodUnsupportedError(_ONLY_GLOBAL)


def remove_process_set(process_set: ProcessSet) -> bool:
    raise HorovodUnsupportedError(_ONLY_GLOBAL)
