"""Slurm: ``srun`` command lines and ``sbatch`` batch scripts.

``srun --nodes=N --ntasks=NP --ntasks-per-node=P [--nodelist=...] [--gpus-per-node=G]
--kill-on-bad-exit=1 program`` starts one task per process; each task finds its
rank in ``SLURM_PROCID`` & co. srun passes its whole environment on, so extra
variables go into srun's own environment. The batch script sets ``MASTER_ADDR``
to the job's first node and ``MASTER_PORT`` from the job id unless given.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

from polytrain.errors import LaunchError
from polytrain.launchers.base import (
    BatchScript,
    CommandLauncher,
    LaunchRequest,
    check_slots,
    procs_per_node,
    refuse_restarts,
    set_values,
)
from polytrain.launchers.failure_report import RankFailure, signal_named
from polytrain.launchers.hostfile import to_slurm_nodelist
from polytrain.launchers.stopping import train_spec_tables

FIRST_NODE = '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
PORT_FROM_JOB_ID = "$((10000 + SLURM_JOB_ID % 20000))"


_SRUN = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+?)\s*$", re.MULTILINE)
_SRUN_EXIT = re.compile(r"Exited with exit code (\d+)")


def _task_ids(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        if first.isdigit():
            ids += range(int(first), int(last) + 1) if last.isdigit() else [int(first)]
    return ids


def parse_srun(text: str) -> list[RankFailure]:
    """srun's "srun: error: node1: task 1: Killed" and "...: tasks 0-1: Exited with exit code 2" lines."""
    failures = []
    for host, tasks, status in _SRUN.findall(text):
        exited = _SRUN_EXIT.search(status)
        how = {"code": int(exited[1])} if exited else {"signal": signal_named(status)}
        failures += [RankFailure(task, host, **how) for task in _task_ids(tasks)]
    return failures


class SrunLauncher(CommandLauncher):
    name = binary = "srun"
    install_hints = {
        "srun": "run inside a Slurm allocation on a machine with Slurm, or write a batch script with --emit-sbatch FILE",
    }
    failure_parsers = (parse_srun,)
    info_binaries = ("srun",)
    batch_script = BatchScript("--emit-sbatch", "write a Slurm batch script instead of running", "sbatch {}")

    def build_command(self, req: LaunchRequest) -> list[str]:
        refuse_restarts(req)
        check_slots(req)
        per_node = procs_per_node(req)
        command = ["srun", f"--nodes={req.num_nodes}", f"--ntasks={req.nproc}", f"--ntasks-per-node={per_node}"]
        if req.hosts:
            command.append(f"--nodelist={to_slurm_nodelist(req.hosts)}")
        if req.slurm.gpus_per_node:
            command.append(f"--gpus-per-node={req.slurm.gpus_per_node}")
        command.append("--kill-on-bad-exit=1")
        return command + list(req.extra_args) + list(req.program)

    def launcher_env(self, req: LaunchRequest) -> dict[str, str]:
        env = {}
        if req.master_addr:
            env["MASTER_ADDR"] = req.master_addr
        if req.master_port:
            env["MASTER_PORT"] = str(req.master_port)
        return {**env, **req.env}

    def emit_script(self, req: LaunchRequest) -> str:
        return emit_sbatch(req)


def _directive(name: str, value: object) -> str:
    text = str(value)
    if not text or any(ch.isspace() for ch in text):
        raise LaunchError(f"--{name.replace('_', '-')} must be one word without spaces, got {text!r}")
    return f"#SBATCH --{name.replace('_', '-')}={text}"


def emit_sbatch(req: LaunchRequest) -> str:
    """A Slurm batch script that runs ``req`` with srun (submit it with ``sbatch FILE``).

    Whatever ``req.launcher`` says, the script starts the tasks with srun itself.
    """
    req = dataclasses.replace(req, launcher="srun")
    srun_line = shlex.join(SrunLauncher().build_command(req))
    options = req.slurm
    directives = [
        _directive("job_name", options.job_name),
        _directive("nodes", req.num_nodes),
        _directive("ntasks_per_node", procs_per_node(req)),
    ]
    for name, value in (
        ("gpus_per_node", options.gpus_per_node),
        ("time", options.time),
        ("partition", options.partition),
        ("account", options.account),
    ):
        if value:
            directives.append(_directive(name, value))
    if req.hosts:
        directives.append(_directive("nodelist", to_slurm_nodelist(req.hosts)))
    name = slurm_signal_name(options.signal) if options.signal else None
    if options.requeue:
        directives.append("#SBATCH --requeue")
    if options.signal:
        directives.append(f"#SBATCH --signal=B:{name}@{options.signal.rpartition('@')[2]}")
    master_addr = shlex.quote(req.master_addr) if req.master_addr else f'"{FIRST_NODE}"'
    master_port = str(req.master_port) if req.master_port else PORT_FROM_JOB_ID
    exports = [f"export {key}={shlex.quote(value)}" for key, value in req.env.items()]
    lines = [
        "#!/bin/bash",
        *directives,
        "# Written by `polytrain launch --emit-sbatch`; submit with: sbatch THIS_FILE",
        "set -euo pipefail",
        "",
        f"export MASTER_ADDR={master_addr}",
        f"export MASTER_PORT={master_port}",
        *exports,
        "",
    ]
    if not (options.requeue or options.signal):
        return "\n".join([*lines, srun_line]) + "\n"
    req = dataclasses.replace(req, program=preemptible_program(req.program, options.requeue, name))
    srun_line = shlex.join(SrunLauncher().build_command(req))
    forwarded = sorted({"TERM", *([name] if name else [])})
    return "\n".join([
        *lines,
        "# The scheduler's signals reach this shell (--signal=B:..., and SIGTERM from scontrol requeue, scancel or",
        "# preemption): pass them on to srun, which passes them to every task; the script ends with srun's code",
        "# (75: preempted, resumable).",
        f"{srun_line} &",
        "srun_pid=$!",
        *(f"trap 'kill -{sig} \"$srun_pid\" 2>/dev/null || true' {sig}" for sig in forwarded),
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" || true; done',
        'wait "$srun_pid"',
    ]) + "\n"


#: what --signal may name: what a run can handle (not KILL, STOP, INT)
SLURM_SIGNALS = ("USR1", "USR2", "TERM", "HUP", "QUIT", "XCPU")


def slurm_signal_name(text: str) -> str:
    """``--signal``'s NAME of ``[B:]NAME@SECONDS`` (``SIG`` prefix and case as you like), or the one-line error."""
    body = text.removeprefix("B:")
    name, at, seconds = body.partition("@")
    name = name.upper().removeprefix("SIG")
    if not at or name not in SLURM_SIGNALS or not seconds.isdigit() or not 1 <= int(seconds) <= 65535:
        raise LaunchError(f"--signal must be NAME@SECONDS with NAME one of {', '.join(SLURM_SIGNALS)} and SECONDS "
                          f"1-65535 (e.g. USR1@120: SIGUSR1 two minutes before the time limit), got {text!r}")
    return name


def preemptible_program(program: tuple[str, ...], requeue: bool, name: str | None) -> tuple[str, ...]:
    """A spec's ``polytrain train`` with what a preemptible batch job needs: the ``preemption`` table handling
    ``name`` (its defaults handle SIGTERM and SIGUSR1), and with ``requeue`` the table's requeue on and
    ``--resume auto`` (a requeued job starts the script again). A script's command is left as it is: the script
    handles the signals itself (``dist.preempted``)."""
    if program[1:4] != ("-m", "polytrain.cli", "train"):
        return program
    given = " ".join(set_values(program[5:]))
    added: list[str] = []
    if "preemption" not in given and "preemption" not in (train_spec_tables(program) or {}):  # not its own
        added += ["--set", "preemption.requeue=auto" if requeue else "preemption.requeue=never"]
    if name and name not in ("TERM", "USR1") and "preemption.signals" not in given:
        added += ["--set", f"preemption.signals=[SIGTERM,SIGUSR1,SIG{name}]"]
    resume = [program[i + 1] for i, a in enumerate(program[:-1]) if a == "--resume"] + [
        a.removeprefix("--resume=") for a in program if a.startswith("--resume=")]
    if requeue and any(value != "auto" for value in resume):
        raise LaunchError(f"--requeue with --resume {resume[-1]}: the requeued job would start from that checkpoint "
                          "again and lose what it trained since; use --resume auto (the run's newest checkpoint)")
    if requeue and not resume:
        added += ["--resume", "auto"]
    return (*program, *added)


LAUNCHER = SrunLauncher()

