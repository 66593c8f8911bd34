"""Where a process sits in a Horovod job, and how Horovod splits rows among ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polytrain.world import World


@dataclass(frozen=True)
class Topology:
    """Horovod's view of where a process sits.

    ``cross_rank``/``cross_size`` are Horovod's: the rank and size of the communicator of
    processes that share this process's local rank (one per node on homogeneous jobs).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool


def topology_from_world(world: World) -> Topology:
    """Topology from the launcher's World alone, assuming the same process count on every node.

    `topology_from_records` gives the exact answer once processes can exchange records.
    """
    return Topology(rank=world.rank, size=world.size, local_rank=world.local_rank,
                    local_size=world.local_size, cross_rank=world.node_rank, cross_size=world.num_nodes,
                    is_homogeneous=world.local_size * world.num_nodes == world.size)


def topology_from_records(records: Sequence[Sequence[int]], rank: int) -> Topology:
    """Exact topology from every rank's ``(node_rank, local_rank, local_size)``, indexed by rank."""
    node, local_rank, local_size = (int(v) for v in records[rank])
    peers = sorted(r for r, rec in enumerate(records) if int(rec[1]) == local_rank)
    node_sizes: dict[int, int] = {}
    for rec in records:
        node_sizes[int(rec[0])] = int(rec[2])
    return Topology(rank=rank, size=len(records), local_rank=local_rank, local_size=local_size,
                    cross_rank=peers.index(rank), cross_size=len(peers),
                    is_homogeneous=len(set(node_sizes.values())) == 1)


def split_rows(rows: int, size: int) -> list[int]:
    """Horovod's reducescatter split of the first dimension: the first ``rows % size`` ranks get one extra row."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]
