"""Open MPI as a singleton (a process started without mpirun that initialises MPI) leaves its shared-memory
segment behind.

Open MPI 5 backs its shared-memory transport with a 16 MiB file in /dev/shm (``sm_segment.<host>...``).
Under mpirun the runtime removes it when the job ends; a singleton — ``polytrain train`` on one process
with ``backend: mpi`` or ``horovod``, a script calling ``hvd.init()`` without a launcher, mpi4py imported
for a world of one — never does, even after a clean MPI_Finalize (measured with 5.0.11: one file per run).
A singleton has no peer to share memory with, so polytrain turns that transport off for it before any
MPI library starts. Nothing changes under a launcher, or when the user chose the transports
(``OMPI_MCA_btl``).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: set by mpirun/PRRTE (Open MPI), PMIx servers (srun --mpi=pmix), or PMI-1/2 (MPICH hydra, srun --mpi=pmi2)
LAUNCHED_BY = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")


def keep_singletons_off_shared_memory(env: MutableMapping[str, str] | None = None) -> bool:
    """Set ``OMPI_MCA_btl=^sm`` for a process no MPI launcher started; whether it did."""
    env = os.environ if env is None else env
    if "OMPI_MCA_btl" in env or any(name in env for name in LAUNCHED_BY):
        return False
    env["OMPI_MCA_btl"] = "^sm"
    return True
