"""``deepspeed`` launcher command lines.

``deepspeed --num_gpus P --num_nodes N [--hostfile F] [--master_addr A] --master_port PORT
--no_local_rank [--module|--no_python] program``. On CPU the launcher counts
processes with ``--num_gpus``. ``--no_local_rank`` is always passed: workers get
``LOCAL_RANK`` in the environment, and neither ``polytrain train`` nor
Horovod-style scripts accept a ``--local_rank`` argument.

Single node: DeepSpeed forces ``MASTER_ADDR=127.0.0.1``; polytrain picks a free
``--master_port`` (DeepSpeed's default 29500 collides with other jobs). Several
hosts: DeepSpeed needs a hostfile (``host slots=N``); given ``-H``, `run` writes
one to a temporary file. Several hosts: ``run`` starts ``deepspeed --no_ssh
--node_rank i`` on each host over ssh (`ssh_fanout`; ``--dry-run`` prints every
host's command) unless ``-- --launcher openmpi`` (etc.) asks for DeepSpeed's own
multi-node runner, where only variables with DeepSpeed's export prefixes or listed
in ``.deepspeed_env`` reach remote workers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile

from polytrain.launchers import ssh_fanout
from polytrain.launchers.base import (
    CommandLauncher,
    LaunchRequest,
    check_slots,
    first_host,
    is_single_local_host,
    procs_per_node,
    python_entry,
    refuse_restarts,
)
from polytrain.launchers.failure_report import RankFailure, from_status
from polytrain.launchers.hostfile import to_deepspeed_hostfile

DEFAULT_MASTER_PORT = 29500
HOSTFILE_PLACEHOLDER = "<temporary hostfile>"


_DEEPSPEED = re.compile(r"^(?:([\w.\-]+): )?.*exits with return code = (-?\d+)\s*$", re.MULTILINE)


def parse_deepspeed(text: str) -> list[RankFailure]:
    """DeepSpeed's launcher logs the return code of the first worker it saw fail, not its rank
    (with pdsh, the line starts with the host's name)."""
    return [RankFailure(None, host or None, **from_status(int(status))) for host, status in _DEEPSPEED.findall(text)]


def _program_args(program: tuple[str, ...]) -> list[str]:
    kind, rest = python_entry(program)
    return {"module": ["--module"], "script": [], "exec": ["--no_python"]}[kind] + rest


def _needs_hostfile(req: LaunchRequest) -> bool:
    return not is_single_local_host(req)


def _fans_out(req: LaunchRequest) -> bool:
    """Several hosts and no ``--launcher`` of DeepSpeed's own among the extra arguments: ssh fan-out."""
    return bool(req.hosts) and _needs_hostfile(req) and not any(
        arg == "--launcher" or arg.startswith("--launcher=") for arg in req.extra_args)


class DeepspeedLauncher(CommandLauncher):
    name = binary = "deepspeed"
    install_hints = {"deepspeed": "install DeepSpeed (pip install deepspeed==0.19.8)"}
    picks_local_port = True
    failure_parsers = (parse_deepspeed,)
    traceback_frames = ("/bin/deepspeed", "/deepspeed/launcher/")
    info_binaries = ("deepspeed",)

    def build_command(self, req: LaunchRequest) -> list[str]:
        refuse_restarts(req)
        check_slots(req)
        command = ["deepspeed", "--num_gpus", str(procs_per_node(req)), "--num_nodes", str(req.num_nodes)]
        if _needs_hostfile(req):
            command += ["--hostfile", req.hostfile or HOSTFILE_PLACEHOLDER]
            command += ["--master_addr", req.master_addr or first_host(req) or "127.0.0.1"]
            command += ["--master_port", str(req.master_port or DEFAULT_MASTER_PORT)]
            if req.num_nodes == 1:
                command.append("--force_multi")  # one remote host: DeepSpeed would otherwise run locally
        else:
            command += ["--master_port", str(req.master_port or DEFAULT_MASTER_PORT)]
        command.append("--no_local_rank")
        return command + list(req.extra_args) + _program_args(req.program)

    def describe(self, req: LaunchRequest) -> str:
        fans_out = _fans_out(req)
        text = ssh_fanout.describe(ssh_fanout.deepspeed_commands(req)) if fans_out else super().describe(req)
        if _needs_hostfile(req) and not req.hostfile:
            lines = to_deepspeed_hostfile(req.hosts).splitlines()
            text = "\n".join([f"# {HOSTFILE_PLACEHOLDER}:", *(f"#   {line}" for line in lines), text])
        return text

    def run(self, req: LaunchRequest) -> int:
        if _fans_out(req):
            refuse_restarts(req)
            check_slots(req)
            return ssh_fanout.run("deepspeed", req, ssh_fanout.deepspeed_commands, self.reading)
        if not _needs_hostfile(req) or req.hostfile:
            return super().run(req)
        with tempfile.TemporaryDirectory(prefix="polytrain-deepspeed-") as tmp:
            path = os.path.join(tmp, "hostfile")
            with open(path, "w") as out:
                out.write(to_deepspeed_hostfile(req.hosts))
            return super().run(dataclasses.replace(req, hostfile=path))


LAUNCHER = DeepspeedLauncher()
