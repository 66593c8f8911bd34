"""Horovod process sets on torch.distributed subgroups.

``add_process_set`` and ``remove_process_set`` create and destroy a
``torch.distributed.new_group``: like every torch subgroup call, **every rank of the job
must call them, in the same order, with the same ranks** — also the ranks that are not
members. (Horovod needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` for adding sets after init;
the shim does not.) Process sets given to ``hvd.init(process_sets=[...])`` are registered
in list order. As in Horovod, ``root_rank`` arguments are global ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from polytrain.horovod.torch.runtime import Runtime, rank, runtime, size


class ProcessSet:
    """A subset of the processes that run collectives together (Horovod's class)."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int] | Any):
        if isinstance(ranks_or_comm, Sequence) or hasattr(ranks_or_comm, "__iter__"):
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
            self.ranks = ranks
        else:
            self.mpi_comm = ranks_or_comm
            self.ranks = _ranks_of_comm(ranks_or_comm)
        self.group: Any = None

    def _invalidate(self) -> None:
        self.process_set_id = None
        self.group = None

    def size(self) -> int | None:
        """Number of processes in the set, or None when it is not registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks) if self.ranks else size()

    def rank(self) -> int | None:
        """This process's rank within the set, or None when the set is not registered."""
        if self.process_set_id is None:
            return None
        if not self.ranks:
            return rank()
        me = rank()
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None when the set holds no ranks yet)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


def _ranks_of_comm(comm: Any) -> list[int]:
    from mpi4py import MPI

    if not isinstance(comm, MPI.Comm):
        raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
    return sorted(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                            MPI.COMM_WORLD.Get_group()))


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def setup_global(state: Runtime) -> None:
    global_process_set.ranks = list(range(state.topology.size))
    global_process_set.group = None
    global_process_set.process_set_id = 0
    state.process_sets[0] = global_process_set


def reset(state: Runtime) -> None:
    for process_set in state.process_sets.values():
        if process_set is not global_process_set:
            process_set._invalidate()
    state.process_sets.clear()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (all ranks must call this, in the same order)."""
    state = runtime()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = list(process_set.ranks or [])
    if not ranks or ranks[0] < 0 or ranks[-1] >= state.topology.size or len(set(ranks)) != len(ranks):
        raise ValueError(f"process set ranks {ranks} must be distinct ranks in 0..{state.topology.size - 1}")
    if any(ps.ranks == ranks for ps in state.process_sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    group = dist.new_group(ranks=ranks) if ranks != list(range(state.topology.size)) else None
    process_set.group = group
    process_set.process_set_id = state.next_process_set_id
    state.next_process_set_id += 1
    _all_made(state, process_set.process_set_id)
    state.process_sets[process_set.process_set_id] = process_set
    return process_set


def _all_made(state: Runtime, set_id: int) -> None:
    """Return once every rank has made the set's group, as Horovod's registration does.

    A rank outside the set makes nothing and would run ahead: rank 0, which hosts the store the members are
    still connecting through, could reach its exit and take the store with it (CI saw the members' gloo
    set-up fail with "Broken pipe"). Every rank calls this in the same order; the wait is on the store, so
    no device collective runs beside a group being made.
    """
    if state.topology.size == 1:
        return
    key = f"process_set/{set_id}/made"
    if state.store.add(key, 1) == state.topology.size:
        state.store.set(f"{key}/all", "1")
    state.store.wait([f"{key}/all"])


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (all ranks must call this); False for the global set."""
    state = runtime()
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or set_id not in state.process_sets:
        return False
    del state.process_sets[set_id]
    group = process_set.group
    process_set._invalidate()
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(group)
    return True


def resolve(process_set: ProcessSet) -> tuple[Any, int, int]:
    """(torch group, size, this process's rank in it) for a collective on ``process_set``."""
    runtime()
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered; pass it to hvd.init(process_sets=...) or "
                         "hvd.add_process_set()")
    if not process_set.included():
        raise ValueError(f"rank {rank()} is not part of {process_set}; only its members may call "
                         "collectives on it")
    return process_set.group, process_set.size(), process_set.rank()


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
