"""IBM LSF: a ``bsub`` batch script that starts the ranks with ``jsrun`` (Summit-style CORAL machines).

``polytrain launch --emit-bsub FILE -np N [--nnodes K | -H ...] SPEC`` writes the script;
submit it with ``bsub < FILE``. Inside, polytrain's LSF environment finds the ranks
(JSM_NAMESPACE_*) and the master (the first compute host of LSB_MCPU_HOSTS, a port from
the job id), so the script needs no MASTER_* variables. Slurm's options map onto LSF's:
``--partition`` → ``-q`` (queue), ``--account`` → ``-P`` (project), ``--time`` → ``-W``
(``[hours:]minutes``), ``--gpus-per-node`` → GPUs per resource set.
"""

from __future__ import annotations

import re
import shlex

from polytrain.errors import LaunchError
from polytrain.launchers.base import (
    BatchScript,
    Launcher,
    LaunchRequest,
    check_slots,
    procs_per_node,
    refuse_restarts,
)


def lsf_walltime(text: str) -> str:
    """Slurm-style ``MM``, ``HH:MM`` or ``HH:MM:SS`` (or ``D-HH:MM:SS``) as LSF's ``[hours:]minutes``."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise LaunchError(f"--time must be MM, HH:MM, HH:MM:SS or D-HH:MM:SS, got {text!r}")
    days, first, second, third = match.groups()
    if second is None:  # minutes only
        hours, minutes = 0, int(first)
    else:
        hours, minutes = int(first), int(second)
        if third is not None and int(third) > 0:
            minutes += 1  # LSF counts whole minutes: round seconds up
    hours += 24 * int(days or 0) + minutes // 60
    return f"{hours}:{minutes % 60:02d}"


def jsrun_command(req: LaunchRequest) -> list[str]:
    """``jsrun`` with one resource set per rank, ``procs_per_node`` of them per host."""
    per_node = procs_per_node(req)
    command = ["jsrun", "--nrs", str(req.nproc), "--rs_per_host", str(per_node), "--tasks_per_rs", "1"]
    if req.slurm.gpus_per_node:
        gpus = int(req.slurm.gpus_per_node)
        if gpus % per_node:
            raise LaunchError(f"--gpus-per-node {gpus} does not split evenly over {per_node} ranks per node")
        command += ["--gpu_per_rs", str(gpus // per_node)]
    return command + list(req.extra_args) + list(req.program)


def emit_bsub(req: LaunchRequest) -> str:
    """An LSF batch script that runs ``req`` with jsrun (submit it with ``bsub < FILE``)."""
    refuse_restarts(req)
    check_slots(req)
    options = req.slurm
    name = options.job_name
    if not name or any(ch.isspace() for ch in name):
        raise LaunchError(f"--job-name must be one word without spaces, got {name!r}")
    directives = [f"#BSUB -J {name}", f"#BSUB -nnodes {req.num_nodes}", f"#BSUB -o {name}.%J.out",
                  f"#BSUB -e {name}.%J.err"]
    if options.time:
        directives.append(f"#BSUB -W {lsf_walltime(options.time)}")
    for flag, value, option in (("-q", options.partition, "--partition"), ("-P", options.account, "--account")):
        if value:
            if any(ch.isspace() for ch in value):
                raise LaunchError(f"{option} must be one word without spaces, got {value!r}")
            directives.append(f"#BSUB {flag} {value}")
    exports = [f"export {key}={shlex.quote(value)}" for key, value in req.env.items()]
    if req.master_addr:
        exports.append(f"export MASTER_ADDR={shlex.quote(req.master_addr)}")
    if req.master_port:
        exports.append(f"export MASTER_PORT={req.master_port}")
    lines = [
        "#!/bin/bash",
        *directives,
        "# Written by `polytrain launch --emit-bsub`; submit with: bsub < THIS_FILE",
        "set -euo pipefail",
        "",
        *exports,
        shlex.join(jsrun_command(req)),
    ]
    return "\n".join(lines) + "\n"


class LsfLauncher(Launcher):
    """Not a ``--launcher`` choice: jsrun runs only inside an LSF job, so polytrain writes the job's script."""

    name = "lsf"
    starts_jobs = False
    info_binaries = ("jsrun",)
    batch_script = BatchScript("--emit-bsub",
                               "write an LSF batch script (jsrun) instead of running; Slurm options map onto LSF's",
                               "bsub < {}")

    def build_command(self, req: LaunchRequest) -> list[str]:
        return jsrun_command(req)

    def emit_script(self, req: LaunchRequest) -> str:
        return emit_bsub(req)
