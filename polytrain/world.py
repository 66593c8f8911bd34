"""Where this process sits in the job: rank, size, node, master address.

`World` is what every other part of polytrain reads. It is built from the environment the
launcher left by `polytrain.environments.detect_world` (one small class per launcher, tried
in an explicit order) and completed by `polytrain.environments.ensure_master` where a
launcher names no rendezvous address (a plain ``mpirun``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    #: None: not known yet, see ``polytrain.environments.ensure_master``.
    master_addr: str | None = "127.0.0.1"
    #: None: not known yet, see ``polytrain.environments.ensure_master``.
    master_port: int | None = None
    launcher: str = "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def master_known(self) -> bool:
        return self.master_addr is not None and self.master_port is not None
