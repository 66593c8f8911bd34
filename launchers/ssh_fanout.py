"""Several hosts over SSH: one per-node launcher on each host, as DeepSpeed's runner does with pdsh.

``polytrain launch --launcher torchrun -H h1:2,h2:2 SPEC`` runs, for node ``i`` of ``N``::

    ssh h<i> 'cd <cwd> && exec <python> -m polytrain.launchers.ssh_guard --env-on-stdin -- \
        <torchrun> --nnodes=N --nproc_per_node=k --node_rank=i --master_addr=h1 --master_port=P ...'

- torchrun's static rendezvous (``--node_rank``): node ranks follow the host order, so rank 0 is on the
  first host (as with ``mpirun -H``) and the store lives there; ``--master-addr``/``--master-port`` override
  (default: the first host, port 29400). DeepSpeed: ``deepspeed --no_ssh --node_rank i --hostfile F`` per
  host (DeepSpeed's own per-node mode; its multi-node runner needs pdsh, which clusters rarely have). Given
  ``-- --launcher X`` DeepSpeed's own runner is used instead, as before.
- The venv, the repository and the working directory are assumed to have the same paths on every host
  (a shared home, as DeepSpeed's runner assumes too); the guard itself must import polytrain with that
  interpreter and no forwarded variable (an installed polytrain, as in a venv).
- ssh does not carry the environment: ``-x`` variables and this process's ``POLYTRAIN_*``, ``GLOO_*``,
  ``NCCL_*``, ``TP_*``, ``TORCH_*``, ``OMP_*``, ``MKL_*``, ``PYTHON*`` and TensorFlow's own ``TF_*``
  variables (`TF_PREFIXES`, `TF_NAMES`; not Terraform's ``TF_VAR_*``/``TF_TOKEN_*``, nor ``TF_CONFIG``,
  which names one task and which polytrain builds for each rank) are sent to the guard as the first line
  of the connection's stdin (JSON), never on a command line: any user of either host could read a
  command line in ``/proc/<pid>/cmdline`` while the job runs, and a ``-x`` value may be a token.
- ``ssh`` is whatever ``ssh`` is on PATH, with the user's ssh configuration (``BatchMode=yes``: a host that
  asks for a password fails at once instead of hanging).
- The guard (`ssh_guard`, on the remote host) runs the launcher in a session of its own and watches its stdin,
  which is the ssh connection: when the connection closes (this process stopped that ssh, or died) it stops
  the launcher's whole process group — SIGTERM, then SIGKILL — so nothing outlives the job on any host.
- Output: each host's stdout and stderr are passed on as they come (lines are not prefixed: the workers say
  their rank, and the failure report reads the launcher's own lines). The exit code is the first non-zero
  one of any host; when a host fails, the others are stopped, and one line says which host failed first.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence

from polytrain.errors import LaunchError
from polytrain.launchers import exit_board
from polytrain.launchers.base import (
    LaunchRequest,
    OutputReading,
    find_binary,
    format_command,
    procs_per_node,
    python_entry,
)
from polytrain.launchers.failure_report import report_launcher_failure
from polytrain.launchers.hostfile import to_deepspeed_hostfile
from polytrain.launchers.launcher_output import LauncherOutput
from polytrain.launchers.processes import exit_code, supervise

DEFAULT_TORCHRUN_PORT = 29400
DEFAULT_DEEPSPEED_PORT = 29500
FORWARDED_PREFIXES = ("POLYTRAIN_", "GLOO_", "NCCL_", "TP_", "TORCH_", "OMP_", "MKL_", "PYTHON")
#: TensorFlow's own variables (logging, oneDNN, threads, GPU memory, XLA, Keras 2, determinism).
TF_PREFIXES = ("TF_CPP_", "TF_ENABLE_", "TF_NUM_", "TF_FORCE_", "TF_GPU_", "TF_XLA_")
TF_NAMES = ("TF_USE_LEGACY_KERAS", "TF_DETERMINISTIC_OPS", "TF_CUDNN_DETERMINISTIC")
ENV_ON_STDIN = "--env-on-stdin"  # = ssh_guard.ENV_ON_STDIN
HOSTFILE_ARG = "{hostfile}"  # = ssh_guard.HOSTFILE_ARG (not imported: `python -m` of a module imported already warns)
SSH_FAILED = 255  # ssh's own exit code when it cannot connect or the connection breaks


@dataclasses.dataclass(frozen=True)
class HostCommand:
    """What runs on one host: ``command`` in ``cwd`` with ``env``, under the guard."""

    host: str
    node_rank: int
    command: tuple[str, ...]
    env: Mapping[str, str]
    hostfile_text: str | None = None
    ranks: tuple[int, ...] = ()  # the global ranks it starts (node ranks follow the host order)


def is_forwarded(name: str) -> bool:
    """Whether this process's variable ``name`` goes to the remote hosts without being asked for with -x."""
    if name == "PYTHONHOME":
        return False
    return name.startswith(FORWARDED_PREFIXES) or name.startswith(TF_PREFIXES) or name in TF_NAMES


def forwarded_env(req: LaunchRequest, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables every remote host gets: this process's forwarded ones, then ``req.env``."""
    environ = os.environ if environ is None else environ
    return {**{k: v for k, v in environ.items() if is_forwarded(k)}, **req.env}


def env_payload(env: Mapping[str, str]) -> bytes:
    """What the guard reads first from its stdin: the variables, as one line of JSON."""
    return json.dumps(dict(env), separators=(",", ":")).encode() + b"\n"


def stdin_pipe(payload: bytes) -> tuple[int, int]:
    """A pipe holding ``payload`` already (grown to fit), so that no write waits for a host to read."""
    read_end, write_end = os.pipe()
    try:
        if len(payload) > fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ):
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, len(payload))
        os.write(write_end, payload)
    except OSError as exc:
        os.close(read_end)
        os.close(write_end)
        raise LaunchError(f"the environment sent to the hosts is {len(payload)} bytes, more than a pipe holds "
                          f"here ({exc.strerror or exc}): forward fewer or shorter variables") from exc
    return read_end, write_end


def _master(req: LaunchRequest, default_port: int) -> tuple[str, int]:
    return req.master_addr or req.hosts[0][0], req.master_port or default_port


def _node_ranks(node: int, per_node: int) -> tuple[int, ...]:
    """The global ranks on node ``node`` (torchrun and DeepSpeed number them node by node)."""
    return tuple(range(node * per_node, (node + 1) * per_node))


def torchrun_commands(req: LaunchRequest, environ: Mapping[str, str] | None = None) -> list[HostCommand]:
    """One torchrun per host, static rendezvous at the first host; node ranks in host order."""
    per_node = procs_per_node(req)
    addr, port = _master(req, DEFAULT_TORCHRUN_PORT)
    kind, rest = python_entry(req.program)
    program = {"module": ["-m"], "script": [], "exec": ["--no_python"]}[kind] + rest
    torchrun = find_binary("torchrun") or "torchrun"
    env = forwarded_env(req, environ)
    return [
        HostCommand(host, i, (torchrun, f"--nnodes={req.num_nodes}", f"--nproc_per_node={per_node}",
                              f"--node_rank={i}", f"--master_addr={addr}", f"--master_port={port}",
                              f"--max_restarts={req.max_restarts}", *req.extra_args, *program), env,
                    ranks=_node_ranks(i, per_node))
        for i, (host, _) in enumerate(req.hosts)
    ]


def deepspeed_commands(req: LaunchRequest, environ: Mapping[str, str] | None = None) -> list[HostCommand]:
    """One ``deepspeed --no_ssh --node_rank i`` per host, all reading the same hostfile (written on each host)."""
    per_node = procs_per_node(req)
    addr, port = _master(req, DEFAULT_DEEPSPEED_PORT)
    kind, rest = python_entry(req.program)
    program = {"module": ["--module"], "script": [], "exec": ["--no_python"]}[kind] + rest
    deepspeed = find_binary("deepspeed") or "deepspeed"
    env = forwarded_env(req, environ)
    text = None if req.hostfile else to_deepspeed_hostfile(req.hosts)
    return [
        HostCommand(host, i, (deepspeed, "--hostfile", req.hostfile or HOSTFILE_ARG, "--no_ssh", "--node_rank",
                              str(i), "--num_gpus", str(per_node), "--num_nodes", str(req.num_nodes),
                              "--master_addr", addr, "--master_port", str(port), "--no_local_rank",
                              *req.extra_args, *program), env, text, _node_ranks(i, per_node))
        for i, (host, _) in enumerate(req.hosts)
    ]


def ssh_command(item: HostCommand, cwd: str | None = None, ssh: str = "ssh") -> list[str]:
    """``ssh -o BatchMode=yes HOST 'cd CWD && exec python -m ...ssh_guard --env-on-stdin [...] -- COMMAND'``.

    No variable's value is on it: ``item.env`` goes on stdin (`env_payload`)."""
    guard = [sys.executable, "-m", "polytrain.launchers.ssh_guard", ENV_ON_STDIN]
    if item.hostfile_text is not None:
        guard += ["--hostfile-text", item.hostfile_text]
    remote = f"cd {shlex.quote(cwd or os.getcwd())} && exec {shlex.join([*guard, '--', *item.command])}"
    return [ssh, "-o", "BatchMode=yes", item.host, remote]


def describe(items: Sequence[HostCommand]) -> str:
    """Every host's ssh line, each under comments naming the host, its node rank and the variables it is sent."""
    lines = []
    for item in items:
        lines.append(f"# {item.host}: node {item.node_rank} of {len(items)}")
        if item.env:
            lines.append(f"#   sent on the connection's stdin: {', '.join(item.env)}")
        lines.append(format_command(ssh_command(item)))
    return "\n".join(lines)


def run(launcher: str, req: LaunchRequest, build: Callable[[LaunchRequest], list[HostCommand]] = torchrun_commands,
        reading: OutputReading | None = None) -> int:
    """Start ``build(req)`` on every host over ssh and wait; the first non-zero exit code of any host.
    ``reading``: the launcher's (`base.Launcher.reading`)."""
    reading = reading or OutputReading()
    ssh = find_binary("ssh")
    if ssh is None:
        raise LaunchError(f"{launcher} on several hosts runs it on each over ssh, but ssh is not on PATH "
                          f"(install openssh-client)")
    with exit_board.board() as board:
        req = dataclasses.replace(req, env={**req.env, exit_board.BOARD_VARIABLE: str(board)})
        items = build(req)
        commands = [ssh_command(item, ssh=ssh) for item in items]
        outputs = [LauncherOutput(fd, debug=req.debug, frames=reading.frames) for fd in (1, 2)]
        failed: list[int | None] = []
        pipes: list[tuple[int, int]] = []  # each guard's stdin: its variables, then open until this process ends
        try:
            pipes += [stdin_pipe(env_payload(item.env)) for item in items]
            with exit_board.DeathWatch(board) as watch:
                outcome = supervise(commands, [dict(os.environ)] * len(commands), stdout=outputs[0].open(),
                                    stderr=outputs[1].open(), stdin=[read_end for read_end, _ in pipes],
                                    on_failure=lambda codes: failed.extend(codes) if not failed else None)
        finally:
            for fd in (fd for pipe in pipes for fd in pipe):
                os.close(fd)
            text = "\n".join(output.finish() for output in reversed(outputs))
        if outcome.code and outcome.signal is None:  # 2 when the rank named had bad input
            records = exit_board.read_board(board)
            return _report(launcher, items, failed, outcome.code, records, text, watch, reading)
    return outcome.code


def _report(launcher: str, items: Sequence[HostCommand], failed: Sequence[int | None], code: int,
            records: Mapping[int, exit_board.RankRecord], text: str, watch: exit_board.DeathWatch,
            reading: OutputReading) -> int:
    """The host that failed first, then (unless only ssh failed, before any rank started) the rank; returns the
    launch's exit code (`failure_report.launch_exit_code`)."""
    first = next((i for i, c in enumerate(failed) if c), None)
    ssh_only = False
    if first is not None:
        host_code = exit_code(failed[first] or 0)
        ssh_only = host_code == SSH_FAILED and not records
        how = ("ssh could not reach it or lost the connection" if host_code == SSH_FAILED
               else f"{launcher} exited with code {host_code}")
        print(f"polytrain launch: host {items[first].host} (node {first} of {len(items)}): {how}; "
              f"stopped the other hosts", file=sys.stderr, flush=True)
        if host_code == SSH_FAILED and _lost_with_host(items[first], records, text):
            return code  # the other hosts' ranks ended because this launch stopped them: naming one would mislead
    if not ssh_only:
        return report_launcher_failure(launcher, code, records, text, watch.deaths_by_rank(records),
                                       watch.signals_by_rank(records), parsers=reading.parsers)
    return code


def _lost_with_host(item: HostCommand, records: Mapping[int, exit_board.RankRecord], text: str) -> bool:
    """After ssh said the host dropped a session it had opened (a killed container or machine), name the ranks
    ``item`` started that recorded no end (where the board is not on a shared file system, the remote ranks
    record nothing here): they went with the host. False when ssh never got through (an unknown or unreachable
    host: its ranks never started) or every one of them recorded its end."""
    if f"Connection to {item.host} closed" not in text:
        return False
    lost = [rank for rank in item.ranks if rank not in records or records[rank].end is None]
    if lost:
        print(f"polytrain launch: rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} on host {item.host} "
              f"ended with the host, recording no exit (its machine or container stopped, or the network to it "
              f"is gone); the ranks on the other hosts were stopped by this launch", file=sys.stderr, flush=True)
    return bool(lost)
