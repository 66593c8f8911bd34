"""The state ``hvd.init()`` leaves, and the topology queries every framework answers from it.

Each framework's shim keeps one `Basics` and aliases its methods (``rank = _basics.rank``),
so rank, size and the rest behave the same in every framework, down to the error raised
before ``hvd.init()``.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from polytrain.horovod.common.topology import Topology

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class HasTopology(Protocol):
    @property
    def topology(self) -> Topology: ...


S = TypeVar("S", bound=HasTopology)


class Basics(Generic[S]):
    """One framework's live state (None before ``hvd.init()`` and after ``hvd.shutdown()``)."""

    def __init__(self) -> None:
        self.current: S | None = None

    def state(self) -> S:
        """The live state; Horovod's ValueError when ``hvd.init()`` has not run."""
        if self.current is None:
            raise ValueError(NOT_INITIALIZED)
        return self.current

    def is_initialized(self) -> bool:
        return self.current is not None

    def size(self) -> int:
        return self.state().topology.size

    def rank(self) -> int:
        return self.state().topology.rank

    def local_size(self) -> int:
        return self.state().topology.local_size

    def local_rank(self) -> int:
        return self.state().topology.local_rank

    def cross_size(self) -> int:
        return self.state().topology.cross_size

    def cross_rank(self) -> int:
        return self.state().topology.cross_rank

    def is_homogeneous(self) -> bool:
        return self.state().topology.is_homogeneous
