"""What ``hvd.init()`` started in this process (see `basics`), for the modules that run collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polytrain.horovod.common import Basics, HorovodSettings, Topology
from polytrain.observe.timeline import NULL
from polytrain.world import World


@dataclass
class Runtime:
    """Everything ``hvd.init()`` sets up; one per process."""

    world: World
    topology: Topology
    settings: HorovodSettings
    store: Any  # torch.distributed.Store
    backend: str
    owns_group: bool
    handles: dict[int, Any] = field(default_factory=dict)
    next_handle: int = 0
    #: collectives submitted per process-set id (the stall report compares these across ranks)
    submitted: dict[int, int] = field(default_factory=dict)
    process_sets: dict[int, Any] = field(default_factory=dict)
    next_process_set_id: int = 1
    #: a collective was abandoned (stall shutdown, mismatch): exit without joining gloo's threads
    broken: bool = False
    #: where each op is recorded (HOROVOD_TIMELINE / start_timeline, or a Trainer's timeline)
    timeline: Any = NULL
    timeline_file: str | None = None
    #: the MPI channel carrying CPU collectives under an MPI launcher (`mpi.MpiEngine`), or None
    mpi: Any = None
    #: submitted ops not launched yet, in submission order (see `pending`)
    queue: list[Any] = field(default_factory=list)
    #: op name -> its not yet synchronized op (Horovod's duplicate-name check)
    active: dict[str, Any] = field(default_factory=dict)
    #: per process-set id, the agreed ops each op was followed by (see `speculate`)
    speculation: dict[int, Any] = field(default_factory=dict)


basics: Basics[Runtime] = Basics()
runtime = basics.state
is_initialized, size, rank = basics.is_initialized, basics.size, basics.rank


def mark_broken() -> None:
    if basics.current is not None:
        basics.current.broken = True
