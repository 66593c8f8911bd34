"""What ``hvd.init()`` started in this process (see `basics`), for the modules that run collectives."""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.horovod.common import Basics, Topology
from polytrain.horovod.tensorflow.engine import Engine
from polytrain.world import World


@dataclass
class Runtime:
    engine: Engine
    topology: Topology
    world: World
    #: whether collectives run on MPI (rather than in one process alone)
    mpi: bool


basics: Basics[Runtime] = Basics()
runtime = basics.state
size, rank = basics.size, basics.rank


def engine() -> Engine:
    """The engine every collective runs on; Horovod's ValueError before ``hvd.init()``."""
    return basics.state().engine
