"""``python -m polytrain.launchers.horovod_worker PROGRAM...``: one rank of the horovodrun fallback under MPI.

mpirun decides which rank runs where; this shim reads that rank (Open MPI, MPICH
/ Intel MPI or PMIx variables), looks its slot up in the host plan the launcher
exported (``POLYTRAIN_HOROVOD_HOSTS``, ``POLYTRAIN_HOROVOD_SIZE``), adds the
per-slot ``HOROVOD_*`` variables horovodrun would have set, and execs PROGRAM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from polytrain.errors import LaunchError
from polytrain.launchers.horovodrun import HOSTS_VARIABLE, SIZE_VARIABLE, slot_plan
from polytrain.launchers.hostfile import parse_hosts_string

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def slot_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The ``HOROVOD_*`` slot variables for the MPI rank described by ``env``."""
    rank_name = next((name for name in RANK_VARIABLES if name in env), None)
    if rank_name is None:
        raise LaunchError(f"horovod_worker runs under mpirun: none of {', '.join(RANK_VARIABLES)} is set")
    for name in (HOSTS_VARIABLE, SIZE_VARIABLE):
        if name not in env:
            raise LaunchError(f"horovod_worker needs {name}, which the polytrain horovodrun fallback exports")
    plan = slot_plan(parse_hosts_string(env[HOSTS_VARIABLE], HOSTS_VARIABLE), int(env[SIZE_VARIABLE]))
    rank = int(env[rank_name])
    if not 0 <= rank < len(plan):
        raise LaunchError(f"{rank_name}={rank} is outside the {len(plan)} slots of {HOSTS_VARIABLE}")
    return plan[rank]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m polytrain.launchers.horovod_worker PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    try:
        os.environ.update(slot_environment(os.environ))
    except LaunchError as exc:
        print(f"polytrain: {exc}", file=sys.stderr)
        return 2
    os.execvp(argv[0], argv)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
