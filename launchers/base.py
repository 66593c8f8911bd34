"""What every launcher shares: the request, the `Launcher` class, binary lookup, ports, and program shapes.

A `LaunchRequest` says *what* to start (N processes of one program, on which
hosts, with which extra environment); each launcher module has one `Launcher`
class that turns it into the real command line of its tool and carries all else
polytrain knows of that tool (install hint, port choice, failure-output parsers,
traceback frames, `polytrain info` row). `registry.LAUNCHERS` lists the classes.
Builders are pure functions of the request so tests can assert on the exact
command; looking binaries up and starting processes happens only in `run`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from polytrain.comm.net import port_to_hold
from polytrain.errors import LaunchError
from polytrain.launchers import exit_board, shm_leftovers
from polytrain.launchers.failure_report import (
    Parser,
    RankFailure,
    parse_launcher_output,
    report_launcher_failure,
)
from polytrain.launchers.launcher_output import LauncherOutput
from polytrain.launchers.processes import supervise
from polytrain.launchers.stopping import stop_policy
from polytrain.spec.files import set_values

SPEC_SUFFIXES = (".yaml", ".yml", ".toml", ".json")

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)*)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class HorovodOptions:
    """horovodrun's own flags; in the fallback they become the HOROVOD_* variables it would set."""

    controller: str | None = None  # "gloo" | "mpi" | None (horovodrun decides)
    network_interfaces: tuple[str, ...] = ()
    start_timeout: int | None = None
    fusion_threshold_mb: int | None = None
    cycle_time_ms: float | None = None
    timeline_filename: str | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.controller not in (None, "gloo", "mpi"):
            raise LaunchError(f"horovod controller must be gloo or mpi, got {self.controller!r}")
        object.__setattr__(self, "network_interfaces", tuple(self.network_interfaces))


@dataclass(frozen=True)
class SlurmOptions:
    """What a Slurm batch script asks the scheduler for (see `srun.emit_sbatch`)."""

    job_name: str = "polytrain"
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int | None = None
    requeue: bool = False  # --requeue: #SBATCH --requeue, and the run requeues itself when preempted
    signal: str | None = None  # --signal NAME@SECONDS: #SBATCH --signal=B:NAME@SECONDS, passed on to the tasks


@dataclass(frozen=True)
class LaunchRequest:
    """N copies of ``program`` under ``launcher``.

    ``launcher`` is a name in the registry (`registry.launcher` refuses any other where the request is
    built, described or run). ``hosts`` is a sequence of ``(host, slots)``; empty means "this host".
    ``hostfile`` keeps the path the hosts came from, for launchers that take the
    file itself. ``env`` is exported to every worker. ``extra_args`` go to the
    launcher verbatim, just before the program. ``debug`` shows the launcher's
    own traceback in full when a rank fails (see `launcher_output`).
    """

    launcher: str
    nproc: int
    program: Sequence[str]
    hosts: Sequence[tuple[str, int]] = ()
    hostfile: str | None = None
    nnodes: int | None = None
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    as_root: bool = field(default_factory=lambda: os.geteuid() == 0)
    mpi_flavour: str | None = None  # "openmpi" | "hydra" | None: ask `mpirun --version`
    horovod: HorovodOptions = field(default_factory=HorovodOptions)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    debug: bool = False
    ray_address: str | None = None  # --launcher ray: an existing cluster (None: a local Ray, started and stopped)
    # the -x names given without a value: ``env`` holds this process's values, which a dry run shows by name only
    env_from_here: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise LaunchError(f"-np must be a positive integer, got {self.nproc!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise LaunchError(f"--max-restarts must be an integer >= 0, got {self.max_restarts!r}")
        if isinstance(self.program, str):
            raise LaunchError(f"program must be a list of arguments, not the string {self.program!r}")
        if not self.program:
            raise LaunchError("the program to launch is empty: give a spec (.yaml/.toml/.json) or a script (.py)")
        if self.mpi_flavour not in (None, "openmpi", "hydra"):
            raise LaunchError(f"--mpi-flavour must be openmpi or hydra, got {self.mpi_flavour!r}")
        if self.nnodes is not None and (not isinstance(self.nnodes, int) or self.nnodes < 1):
            raise LaunchError(f"--nnodes must be a positive integer, got {self.nnodes!r}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchError(f"--master-port must be in 1..65535, got {self.master_port}")
        hosts = tuple((str(h), int(s)) for h, s in self.hosts)
        for host, slots in hosts:
            if slots < 1:
                raise LaunchError(f"host {host!r} has {slots} slots; slots must be a positive integer")
        if self.nnodes is not None and hosts and self.nnodes != len(hosts):
            raise LaunchError(f"--nnodes {self.nnodes} contradicts the {len(hosts)} hosts given with -H/--hostfile")
        for key in self.env:
            if not _ENV_NAME.match(str(key)):
                raise LaunchError(f"-x/--env: {key!r} is not a valid environment variable name")
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "program", tuple(self.program))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in self.env.items()})

    @property
    def num_nodes(self) -> int:
        return len(self.hosts) if self.hosts else (self.nnodes or 1)

    @property
    def total_slots(self) -> int | None:
        return sum(slots for _, slots in self.hosts) if self.hosts else None


def procs_per_node(req: LaunchRequest) -> int:
    """-np split evenly over the nodes; launchers that start P per node need it to divide."""
    nodes = req.num_nodes
    if req.nproc % nodes:
        raise LaunchError(f"-np {req.nproc} does not divide evenly over {nodes} nodes; "
                          f"{req.launcher} starts the same number of processes on every node")
    return req.nproc // nodes


def check_slots(req: LaunchRequest) -> None:
    """Refuse -np larger than the slots the hosts offer (Horovod and Open MPI refuse it too)."""
    total = req.total_slots
    if total is not None and req.nproc > total:
        raise LaunchError(f"-np {req.nproc} is more than the {total} slots given with -H/--hostfile")


def refuse_restarts(req: LaunchRequest) -> None:
    if req.max_restarts:
        raise LaunchError(f"--max-restarts is supported by the torchrun and local launchers, not {req.launcher}")


def first_host(req: LaunchRequest) -> str | None:
    return req.hosts[0][0] if req.hosts else None


def local_host_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}
    try:
        names.update({socket.gethostname(), socket.getfqdn()})
    except OSError:
        pass
    return names


def is_single_local_host(req: LaunchRequest) -> bool:
    """No hosts at all, or only hosts that are this machine."""
    local = local_host_names()
    return all(host in local for host, _ in req.hosts)


def find_binary(name: str) -> str | None:
    """``name`` next to ``sys.executable`` (the venv's bin/) first, then on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def is_python(executable: str) -> bool:
    return executable == sys.executable or bool(_PYTHON_NAME.match(os.path.basename(executable)))


def python_entry(program: Sequence[str]) -> tuple[str, list[str]]:
    """How a launcher that runs Python itself (torchrun, deepspeed) should take ``program``.

    Returns ``("module", [mod, *args])`` for ``python -m mod``, ``("script",
    [path, *args])`` for ``python path``, ``("exec", program)`` for anything else.
    """
    program = list(program)
    if len(program) >= 2 and is_python(program[0]):
        if program[1] == "-m" and len(program) >= 3:
            return "module", program[2:]
        if not program[1].startswith("-"):
            return "script", program[1:]
    return "exec", program


def program_for_target(target: str, args: Sequence[str] = ()) -> tuple[str, ...]:
    """The command each worker runs: a spec through ``polytrain train``, or a Python script."""
    if target.endswith(".py"):
        return (sys.executable, target, *args)
    if target.endswith(SPEC_SUFFIXES):
        return (sys.executable, "-m", "polytrain.cli", "train", target, *args)
    raise LaunchError(f"launch target {target!r} must be a training spec ({', '.join(SPEC_SUFFIXES)}) or a Python "
                      "script (.py)")


def launch_spec(target: str, program_args: Sequence[str]) -> Any:
    """The spec file ``target`` with the ``--set`` overrides among ``program_args``, validated without importing
    what it names by import path (see `args.check_spec`)."""
    from polytrain import validation
    from polytrain.spec.files import apply_overrides, load_raw
    from polytrain.spec.user_code import imports_skipped

    raw = apply_overrides(load_raw(target), set_values(program_args))
    with imports_skipped():
        return validation.from_dict(raw)


def format_command(command: Sequence[str], env: Mapping[str, str] | None = None, by_name: Sequence[str] = ()) -> str:
    """One shell line: ``VAR=value ... command``, quoted so it can be pasted; a variable in ``by_name`` (``-x NAME``
    without a value, perhaps a token) as ``VAR="$VAR"``: its name, never its value (pasted: the shell's goes on)."""
    prefix = [f'{key}="${key}"' if key in by_name else f"{key}={shlex.quote(str(value))}"
              for key, value in (env or {}).items()]
    return " ".join([*prefix, shlex.join(command)])


def master_env(req: LaunchRequest, default_addr: str, port: int) -> dict[str, str]:
    return {"MASTER_ADDR": req.master_addr or default_addr, "MASTER_PORT": str(req.master_port or port)}


@dataclass(frozen=True)
class OutputReading:
    """How a launcher's output is read while it runs: the failure parsers that name the rank that failed and
    the path fragments (regular expressions) of a launcher's own traceback frames, held back unless
    ``--debug`` (`launcher_output`). `registry.output_reading` gives every launcher those of all registered
    launchers, in registry order: a job's output holds what every layer of it printed (an MPI library's
    abort line under srun, Open MPI's lines under horovodrun)."""

    parsers: tuple[Parser, ...] = ()
    frames: tuple[str, ...] = ()

    def parse(self, text: str) -> list[RankFailure]:
        return parse_launcher_output(text, self.parsers)


@dataclass(frozen=True)
class BatchScript:
    """A batch script a launcher writes instead of running: ``polytrain launch FLAG FILE``."""

    flag: str  # "--emit-sbatch"
    help: str
    submit: str  # how to submit it, "{}" standing for the file: "sbatch {}"

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


class Launcher:
    """One launcher and everything polytrain knows of it. Subclasses set the class attributes and implement
    ``build_command`` (pure: bare binary name first), ``describe`` and ``run``; a launcher with a
    ``batch_script`` implements ``emit_script``. The registry (`registry.LAUNCHERS`) lists the classes, and
    the ``--launcher`` choices, install hints, port choice, failure parsers, traceback frames and
    ``polytrain info`` rows are read from there.

    ``reading``: how `run` reads the output (default: this launcher's own parsers and frames; the registry
    gives every launcher those of all launchers).
    """

    name: ClassVar[str] = ""  # the --launcher choice
    starts_jobs: ClassVar[bool] = True  # False: not a --launcher choice, it only writes a batch script
    install_hints: ClassVar[Mapping[str, str]] = {}  # binary -> how to get it, for "not found on PATH"
    picks_local_port: ClassVar[bool] = False  # its single-host command carries a port polytrain picks
    failure_parsers: ClassVar[tuple[Parser, ...]] = ()  # what its output says of failed ranks
    traceback_frames: ClassVar[tuple[str, ...]] = ()  # regexes of the paths of its own code
    info_binaries: ClassVar[tuple[str, ...]] = ()  # the binaries `polytrain info` looks up
    batch_script: ClassVar[BatchScript | None] = None

    def __init__(self, reading: OutputReading | None = None) -> None:
        self.reading = reading or OutputReading(self.failure_parsers, self.traceback_frames)

    def build_command(self, req: LaunchRequest) -> list[str]:
        raise NotImplementedError

    def describe(self, req: LaunchRequest) -> str:
        raise NotImplementedError

    def run(self, req: LaunchRequest) -> int:
        raise NotImplementedError

    def emit_script(self, req: LaunchRequest) -> str:
        raise NotImplementedError

    def install_hint(self, binary: str) -> str:
        return self.install_hints.get(binary, f"install {binary}")

    def require_binary(self, name: str) -> str:
        path = find_binary(name)
        if path is None:
            raise LaunchError(f"{name} not found on PATH: {self.install_hint(name)}")
        return path

    def with_master_port(self, req: LaunchRequest) -> LaunchRequest:
        """``req`` with a free port chosen once for a single-host job that names none, before any command is
        built: the builders stay pure, and ``--dry-run`` prints the port the real run would use. (The
        ``local`` launcher picks a fresh port for every restart attempt itself.)"""
        if req.master_port is not None or not self.picks_local_port or not is_single_local_host(req):
            return req
        # below the ephemeral range, with a port per rank after it free too (tf-multiworker listens on master_port + 1
        # + local rank): an outgoing connection's local end cannot take them between now and the start
        return dataclasses.replace(req, master_port=port_to_hold("", count=1 + req.nproc))


class CommandLauncher(Launcher):
    """A launcher that is an external program: build its command line, then run it.

    Subclasses set ``name``/``binary`` and implement ``build_command`` (pure: bare
    binary name first) and optionally ``launcher_env`` (variables for the launcher
    process itself, which passes them on to the workers).

    ``run`` gives the workers an exit board (`exit_board`), passes the launcher's
    stdout and stderr on through `launcher_output` (its own traceback held back),
    and when the launcher fails says in one line which rank failed, on which host,
    and how (`failure_report`). A launcher whose ranks may leave MPI shared-memory
    files behind when killed (``leaves_shm``) has the orphans removed (`shm_leftovers`).
    """

    binary = ""
    leaves_shm = False

    def ends_ranks_on_term(self, req: LaunchRequest) -> bool:  # rather than letting them stop (`stopping`)
        return False

    def launcher_env(self, req: LaunchRequest) -> dict[str, str]:
        return dict(req.env)

    def binary_name(self, req: LaunchRequest) -> str:
        return self.binary

    def resolved_command(self, req: LaunchRequest, *, required: bool) -> list[str]:
        command = self.build_command(req)
        name = self.binary_name(req)
        path = self.require_binary(name) if required else find_binary(name)
        return [path or command[0], *command[1:]]

    def describe(self, req: LaunchRequest) -> str:
        text = format_command(self.resolved_command(req, required=False), self.launcher_env(req), req.env_from_here)
        if find_binary(self.binary_name(req)) is None:
            name = self.binary_name(req)
            text += f"\n# note: {name} not found on PATH: {self.install_hint(name)}"
        return text

    def run(self, req: LaunchRequest, hidden: Iterable[str] = ()) -> int:
        """Run the launcher and wait; ``hidden``: variables of this process the launcher must not get."""
        with exit_board.board() as board:
            req = dataclasses.replace(req, env={**req.env, exit_board.BOARD_VARIABLE: str(board)})
            command = self.resolved_command(req, required=True)
            outputs = [LauncherOutput(fd, debug=req.debug, frames=self.reading.frames) for fd in (1, 2)]
            shm_before = shm_leftovers.present() if self.leaves_shm else None
            stop = stop_policy(req.program, self.ends_ranks_on_term(req))
            try:
                with exit_board.DeathWatch(board) as watch:
                    base = {k: v for k, v in os.environ.items() if k not in set(hidden)}
                    outcome = supervise([command], [{**base, **self.launcher_env(req)}], grace=stop.grace,
                                        forward_as=stop.forward_as, stdout=outputs[0].open(), stderr=outputs[1].open())
            finally:
                text = "\n".join(output.finish() for output in reversed(outputs))
                if shm_before is not None:
                    shm_leftovers.remove_orphans(shm_before)
            if outcome.code and outcome.signal is None:
                records = exit_board.read_board(board)
                return report_launcher_failure(self.binary_name(req), outcome.code, records, text,
                                               watch.deaths_by_rank(records), watch.signals_by_rank(records),
                                               parsers=self.reading.parsers)
        return outcome.code
