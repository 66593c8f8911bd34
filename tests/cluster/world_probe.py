"""Run as one rank of a real launcher (srun, MPICH's mpiexec): print this rank's host, the `World` polytrain
detects from the launcher's variables, and those variables, as JSON: one line ``world_probe: {...}`` on stdout, or, given a directory, a file ``DIR/<host>-<pid>.json``
(launchers may interleave long lines from several ranks).

With ``--mpi`` the rank also joins MPI (mpi4py) and reports the library it loaded and MPI's own rank/size,
so a test can check that polytrain and the MPI library agree, and the World after the ranks agreed on a
master over MPI (`polytrain.environments.ensure_master`: exact node ranks from the gathered host names).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from pathlib import Path

from polytrain.environments import detect_world, ensure_master, environment_for
from polytrain.errors import EnvironmentDetectionError

PREFIXES = ("SLURM", "PMI_", "MPI_LOCAL", "HYDRA_", "MASTER_")


def main(argv: list[str]) -> int:
    report: dict[str, object] = {
        "host": socket.gethostname(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(PREFIXES) and k != "SLURM_CONF"},
    }
    try:
        world = detect_world()
        report["world"] = dataclasses.asdict(world)
        report["environment"] = environment_for(os.environ).__name__
    except EnvironmentDetectionError as exc:
        report["error"] = str(exc)
    if "--mpi" in argv:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        report["mpi"] = {"library": MPI.Get_library_version().splitlines()[0], "rank": comm.Get_rank(),
                         "size": comm.Get_size(), "sum": comm.allreduce(1)}
        if "world" in report:
            report["agreed"] = dataclasses.asdict(ensure_master(world))
    text = json.dumps(report, sort_keys=True)
    folders = [a for a in argv if not a.startswith("--")]
    if folders:
        (Path(folders[0]) / f"{report['host']}-{os.getpid()}.json").write_text(text)
    else:
        print("world_probe: " + text, flush=True)
    return 2 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
