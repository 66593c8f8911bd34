"""``mpirun`` command lines, Open MPI flavour and MPICH / Intel MPI (hydra) flavour.

Open MPI: ``mpirun -np N [-H h:s,... --map-by slot | --hostfile F --map-by slot]
[--allow-run-as-root] [--oversubscribe] --bind-to none -x VAR=value ... program``.
``--allow-run-as-root`` only for root; ``--oversubscribe`` only when no hosts
are given and -np exceeds this machine's physical cores (Open MPI's default
slot count). ``--map-by slot`` fills hosts in order, the placement Horovod
assumes; ``--bind-to none`` leaves intra-op threads free, as horovodrun does.

Hydra: ``mpiexec -n N [-hosts h:s,...] -genv VAR value ... program``.

Workers also get ``MASTER_ADDR``/``MASTER_PORT`` so torch.distributed can use
``env://`` under MPI. The flavour comes from ``mpirun --version`` unless forced
with ``--mpi-flavour``.
"""

from __future__ import annotations

import functools
import os
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
    for key, value in worker_env(req).items():
        command += ["-x", f"{key}={value}"]
    return command + list(req.extra_args) + list(req.program)


def hydra_command(req: LaunchRequest) -> list[str]:
    command = ["mpiexec", "-n", str(req.nproc)]
    if req.hosts:
        command += ["-hosts", to_hosts_string(req.hosts)]
    for key, value in worker_env(req).items():
        command += ["-genv", key, value]
    return command + list(req.extra_args) + list(req.program)


class MpirunLauncher(CommandLauncher):
    name = "mpirun"
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
        return {}  # exported with -x / -genv on the command line


LAUNCHER = MpirunLauncher()
