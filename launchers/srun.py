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
)
from polytrain.launchers.failure_report import RankFailure, signal_named
from polytrain.launchers.hostfile import to_slurm_nodelist

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
        srun_line,
    ]
    return "\n".join(lines) + "\n"


LAUNCHER = SrunLauncher()
