"""``horovodrun`` command lines, and what to do when horovodrun is not installed.

With horovodrun on PATH: ``horovodrun -np N [-H ...|--hostfile F] [--gloo|--mpi]
[--network-interfaces ...] [--start-timeout S] [--fusion-threshold-mb X]
[--cycle-time-ms X] [--timeline-filename F] [--verbose] program``.

Without it (Horovod no longer builds on most stacks) polytrain starts the workers
itself with the variables horovodrun's gloo mode gives them (Horovod 0.28.1,
``horovod/runner/gloo_run.py``: ``create_slot_env_vars`` and ``create_run_envs``,
plus the ``HOROVOD_*`` tunables of ``config_parser.set_env_from_args``) and
``MASTER_ADDR``/``MASTER_PORT`` for torch.distributed:

- one host (this one): the local starter of `polytrain.launchers.local`;
- several hosts: through mpirun, each rank passing through
  ``python -m polytrain.launchers.horovod_worker`` which adds its per-slot
  ``HOROVOD_RANK``/``LOCAL_RANK``/``CROSS_RANK``... from the host plan;
- ``--mpi``: through mpirun with ``HOROVOD_CONTROLLER=mpi``,
  ``HOROVOD_CPU_OPERATIONS=mpi`` and the tunables; ranks come from MPI, as in
  horovodrun's MPI mode.

``HOROVOD_GLOO_RENDEZVOUS_PORT`` equals ``MASTER_PORT`` in the fallback: there is
no Horovod HTTP rendezvous server, and an environment detector reading either
variable finds the same torch.distributed store. ``--start-timeout`` only
concerns horovodrun's own start-up and has no fallback equivalent.

The real horovodrun in gloo mode (``--gloo``, or no controller named) writes its whole
environment into each rank's command line (``sh -c``, and ``ssh`` for other hosts), so
``-x`` variables are kept out of its environment (also when their value came from this
process's own): they reach the ranks through a 0600 file read by `env_relay` in front of
the program (in the working directory when ranks run on other hosts, which must then
share it). Any other variable of the launching environment is Horovod's to write there.
In MPI mode horovodrun passes ``-x NAME`` to mpirun by name, as polytrain's own mpirun
command does.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from polytrain.launchers import env_relay, local, mpirun
from polytrain.launchers.base import (
    CommandLauncher,
    LaunchRequest,
    check_slots,
    find_binary,
    first_host,
    is_single_local_host,
    refuse_restarts,
)
from polytrain.launchers.hostfile import to_hosts_string

HOSTS_VARIABLE = "POLYTRAIN_HOROVOD_HOSTS"
SIZE_VARIABLE = "POLYTRAIN_HOROVOD_SIZE"
WORKER_MODULE = "polytrain.launchers.horovod_worker"


def slot_plan(hosts: Sequence[tuple[str, int]], nproc: int) -> list[dict[str, str]]:
    """Per-rank ``HOROVOD_*`` slot variables: ranks fill hosts in order, as horovodrun assigns them.

    The cross rank of a slot is its host's position among the hosts that have a
    slot with the same local rank; the cross size is how many such hosts there are.
    """
    placed: list[tuple[str, int, int]] = []  # (host, rank, local_rank)
    for host, slots in hosts:
        for local_rank in range(slots):
            if len(placed) == nproc:
                break
            placed.append((host, len(placed), local_rank))
    local_sizes: dict[str, int] = {}
    hosts_at_local_rank: dict[int, list[str]] = {}
    for host, _, local_rank in placed:
        local_sizes[host] = local_sizes.get(host, 0) + 1
        hosts_at_local_rank.setdefault(local_rank, []).append(host)
    return [
        {
            "HOROVOD_HOSTNAME": host,
            "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(len(placed)),
            "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(local_sizes[host]),
            "HOROVOD_CROSS_RANK": str(hosts_at_local_rank[local_rank].index(host)),
            "HOROVOD_CROSS_SIZE": str(len(hosts_at_local_rank[local_rank])),
        }
        for host, rank, local_rank in placed
    ]


def tunable_env(req: LaunchRequest) -> dict[str, str]:
    """The ``HOROVOD_*`` knobs horovodrun sets from its flags."""
    options = req.horovod
    env = {}
    if options.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(options.fusion_threshold_mb * 1024 * 1024)
    if options.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = str(options.cycle_time_ms)
    if options.timeline_filename:
        env["HOROVOD_TIMELINE"] = options.timeline_filename
    return env


def run_env(req: LaunchRequest, addr: str, port: int, nics: Sequence[str]) -> dict[str, str]:
    """Variables common to every gloo-mode worker (``create_run_envs`` plus MASTER_*)."""
    env = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
    }
    if nics:
        env["HOROVOD_GLOO_IFACE"] = nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    env.update(tunable_env(req))
    env.update({"PYTHONUNBUFFERED": "1", "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    return {**env, **req.env}


def fallback_environments(req: LaunchRequest, port: int, restart_count: int = 0) -> list[dict[str, str]]:
    """Each local worker's variables when polytrain stands in for ``horovodrun --gloo`` on this host."""
    hosts = req.hosts or (("localhost", req.nproc),)
    addr = req.master_addr or local.LOOPBACK
    common = run_env(req, addr, port, req.horovod.network_interfaces or ("lo",))
    return [{**common, **slot} for slot in slot_plan(hosts, req.nproc)]


def mpirun_fallback_request(req: LaunchRequest) -> LaunchRequest:
    """The mpirun request that stands in for horovodrun across several hosts (or for ``--mpi``)."""
    port = req.master_port or mpirun.DEFAULT_REMOTE_MASTER_PORT
    addr = req.master_addr or first_host(req) or local.LOOPBACK
    if req.horovod.controller == "mpi":
        env = {"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi", **tunable_env(req),
               "PYTHONUNBUFFERED": "1", **req.env}
        program = req.program
    else:
        env = {
            **run_env(req, addr, port, req.horovod.network_interfaces),
            HOSTS_VARIABLE: to_hosts_string(req.hosts or (("localhost", req.nproc),)),
            SIZE_VARIABLE: str(req.nproc),
        }
        program = (sys.executable, "-m", WORKER_MODULE, *req.program)
    return dataclasses.replace(
        req, launcher="mpirun", env=env, program=program, master_addr=addr, master_port=port
    )


RELAY_PLACEHOLDER = "<temporary file>"


def _relays(req: LaunchRequest) -> bool:
    """Whether -x variables must bypass the real horovodrun's environment (see the module doc)."""
    return bool(req.env) and req.horovod.controller != "mpi"


def _relayed(req: LaunchRequest, path: str) -> LaunchRequest:
    return dataclasses.replace(req, env={}, program=env_relay.relayed(path, req.program))


def _uses_local_starter(req: LaunchRequest) -> bool:
    return req.horovod.controller != "mpi" and is_single_local_host(req)


class HorovodrunLauncher(CommandLauncher):
    name = binary = "horovodrun"
    install_hints = {"horovodrun": "install Horovod (pip install horovod==0.28.1)"}
    picks_local_port = True
    failure_parsers = mpirun.MpirunLauncher.failure_parsers  # in MPI mode it is an mpirun
    info_binaries = ("horovodrun",)
    leaves_shm = True  # horovodrun runs mpirun: Open MPI's sm_segment files of killed ranks

    def build_command(self, req: LaunchRequest) -> list[str]:
        refuse_restarts(req)
        check_slots(req)
        options = req.horovod
        command = ["horovodrun", "-np", str(req.nproc)]
        if req.hostfile:
            command += ["--hostfile", req.hostfile]
        elif req.hosts:
            command += ["-H", to_hosts_string(req.hosts)]
        if options.controller:
            command.append(f"--{options.controller}")
        if options.network_interfaces:
            command += ["--network-interfaces", ",".join(options.network_interfaces)]
        for flag, value in (
            ("--start-timeout", options.start_timeout),
            ("--fusion-threshold-mb", options.fusion_threshold_mb),
            ("--cycle-time-ms", options.cycle_time_ms),
            ("--timeline-filename", options.timeline_filename),
        ):
            if value is not None:
                command += [flag, str(value)]
        if options.verbose:
            command.append("--verbose")
        return command + list(req.extra_args) + list(req.program)

    def launcher_env(self, req: LaunchRequest) -> dict[str, str]:
        """horovodrun passes its environment on to every worker, also over ssh: MASTER_ADDR/MASTER_PORT for
        torch.distributed backends (Horovod's own rendezvous is not a torch store), then ``req.env``."""
        return mpirun.worker_env(req)

    def describe(self, req: LaunchRequest) -> str:
        if find_binary(self.binary) is not None:
            if not _relays(req):
                return super().describe(req)
            comment = f"# {RELAY_PLACEHOLDER} (mode 0600) holds the -x variables {', '.join(req.env)}\n"
            return comment + super().describe(_relayed(req, RELAY_PLACEHOLDER))
        refuse_restarts(req)
        check_slots(req)
        title = "horovodrun not found: polytrain starts the workers as horovodrun --gloo would"
        if _uses_local_starter(req):
            return local.describe_group(req, fallback_environments, title)
        return f"# {title}, through mpirun\n" + self._mpirun().describe(mpirun_fallback_request(req))

    def run(self, req: LaunchRequest) -> int:
        if find_binary(self.binary) is not None:
            if not _relays(req):
                return super().run(req)
            with env_relay.env_file(req.env, None if is_single_local_host(req) else os.getcwd()) as path:
                return super().run(_relayed(req, str(path)), hidden=req.env)
        if req.horovod.verbose:
            print(self.describe(req), file=sys.stderr, flush=True)
        refuse_restarts(req)
        check_slots(req)
        if _uses_local_starter(req):
            return local.run_group(req, fallback_environments)
        return self._mpirun().run(mpirun_fallback_request(req))

    def _mpirun(self) -> mpirun.MpirunLauncher:
        """The mpirun that stands in for a missing horovodrun, reading the output as this launcher does."""
        return mpirun.MpirunLauncher(self.reading)


LAUNCHER = HorovodrunLauncher()
