"""Debian's MPICH (Hydra's ``mpiexec``) beside the venv's Open MPI, on a `netns.Cluster`.

Hydra reaches the other hosts with the cluster's ssh wrapper (``-launcher ssh -launcher-exec``); every rank
it starts gets ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``.

mpi4py under MPICH: the venv's mpi4py 4.x wheel carries one extension per MPI ABI (``MPI.openmpi`` and
``MPI.mpich``) and picks one at import time. ``MPI4PY_MPIABI=mpich`` selects the MPICH one, which links
``libmpi.so.12`` (the MPICH ABI's name); Debian ships that library as ``libmpich.so.12`` only, so a
directory with a ``libmpi.so.12`` link to it goes on ``LD_LIBRARY_PATH``. One venv serves both MPIs; nothing
system-wide changes (Debian's ``mpich`` package does take over /usr/bin/mpirun, mpiexec and mpicc through
update-alternatives, but the venv's bin/ comes first for polytrain and the tests).

No pytest import here (benches use it too).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from netns import Cluster

HYDRA = "mpiexec.hydra"
LIBMPICH = "libmpich.so.12"
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def libmpich() -> Path | None:
    for directory in LIB_DIRS:
        path = Path(directory) / LIBMPICH
        if path.exists():
            return path
    return None


def hydra() -> str | None:
    return shutil.which(HYDRA, path=os.pathsep.join(["/usr/bin", os.environ.get("PATH", "")]))


def mpich_unavailable() -> str | None:
    """Why MPICH cannot run here (None when it can)."""
    if hydra() is None:
        return f"{HYDRA} not found (apt-get install mpich)"
    if libmpich() is None:
        return f"{LIBMPICH} not found (apt-get install mpich)"
    return None


def abi_dir(workdir: Path) -> Path:
    """``workdir/mpich-abi`` with ``libmpi.so.12`` → Debian's ``libmpich.so.12`` (for mpi4py's MPICH ABI)."""
    directory = Path(workdir) / "mpich-abi"
    directory.mkdir(parents=True, exist_ok=True)
    link = directory / "libmpi.so.12"
    if not link.is_symlink():
        link.symlink_to(libmpich())
    return directory


def mpich_env(cluster: Cluster, workdir: Path, **extra: str) -> dict[str, str]:
    """The cluster's environment with mpi4py pointed at MPICH (see the module's note)."""
    library_path = [str(abi_dir(workdir))]
    if os.environ.get("LD_LIBRARY_PATH"):
        library_path.append(os.environ["LD_LIBRARY_PATH"])
    return cluster.env(MPI4PY_MPIABI="mpich", LD_LIBRARY_PATH=os.pathsep.join(library_path), **extra)


def mpiexec(cluster: Cluster, n: int, hosts: str, program: Sequence[str]) -> list[str]:
    """``mpiexec.hydra -n N -hosts HOSTS`` over the cluster's ssh, running ``program`` on every rank."""
    return [hydra() or HYDRA, "-n", str(n), "-hosts", hosts, "-launcher", "ssh",
            "-launcher-exec", str(cluster.bin / "ssh"), *program]
