"""``torchrun`` (torch.distributed.elastic) command lines.

Single node: c10d rendezvous on ``127.0.0.1:<port>`` (a free one, chosen by ``with_master_port``) with ``--local_addr``
pinned to loopback — unlike ``--standalone`` this never depends on how the
machine's hostname resolves, and workers get ``MASTER_ADDR=127.0.0.1``.
Several nodes: c10d rendezvous at ``--master-addr`` (default: the first host),
port ``--master-port`` (default 29400, torchrun's own); ``build_command`` is the
one command to run by hand on every node; with ``-H``/``--hostfile``, ``run`` starts torchrun on each
host over ssh and ``--dry-run`` prints every host's command (`ssh_fanout`).

Python programs are handed over the way torchrun wants them: ``-m module`` or
the script path (torchrun adds its own interpreter); anything else goes with
``--no_python``.
"""

from __future__ import annotations

import re

from polytrain.errors import LaunchError
from polytrain.launchers import ssh_fanout
from polytrain.launchers.base import (
    CommandLauncher,
    LaunchRequest,
    first_host,
    is_single_local_host,
    procs_per_node,
    python_entry,
)
from polytrain.launchers.failure_report import RankFailure, from_status

DEFAULT_RDZV_PORT = 29400
RDZV_ID = "polytrain"
_LOOPBACK_NAMES = ("127.0.0.1", "localhost")


_TORCHRUN_ENTRY = re.compile(r"host\s*:\s*(\S+)\s*\n\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
_TORCHRUN_LOG = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def parse_torchrun(text: str) -> list[RankFailure]:
    """torchrun's ``ChildFailedError`` block: the root cause, then the other failures; else its log lines
    ("failed (exitcode: -9) local_rank: 1", right for the single node `polytrain launch` runs)."""
    failures: list[RankFailure] = []
    start = text.rfind("ChildFailedError")
    if start >= 0:
        block = text[start:]
        cause_at = block.find("Root Cause")
        parts = [block[cause_at:], block[:cause_at]] if cause_at >= 0 else [block]
        for part in parts:
            for host, rank, status in _TORCHRUN_ENTRY.findall(part):
                failures.append(RankFailure(int(rank), host, **from_status(int(status))))
    if not failures:
        for status, rank in _TORCHRUN_LOG.findall(text):
            failures.append(RankFailure(int(rank), **from_status(int(status))))
    return failures


def _program_args(program: tuple[str, ...]) -> list[str]:
    kind, rest = python_entry(program)
    return {"module": ["-m"], "script": [], "exec": ["--no_python"]}[kind] + rest


class TorchrunLauncher(CommandLauncher):
    name = binary = "torchrun"
    install_hints = {"torchrun": "install PyTorch (pip install torch)"}
    picks_local_port = True
    failure_parsers = (parse_torchrun,)
    traceback_frames = ("/bin/torchrun", "/torch/distributed/")
    info_binaries = ("torchrun",)

    def build_command(self, req: LaunchRequest) -> list[str]:
        per_node = procs_per_node(req)
        nodes = req.num_nodes
        command = ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={per_node}", "--rdzv_backend=c10d"]
        if nodes == 1 and is_single_local_host(req):
            addr = req.master_addr or "127.0.0.1"
            command.append(f"--rdzv_endpoint={addr}:{req.master_port or DEFAULT_RDZV_PORT}")
            if addr in _LOOPBACK_NAMES:
                command.append("--local_addr=127.0.0.1")
        else:
            addr = req.master_addr or first_host(req)
            if addr is None:
                raise LaunchError(
                    f"torchrun on {nodes} nodes needs --master-addr (the rendezvous host) or -H/--hostfile"
                )
            command += [f"--rdzv_endpoint={addr}:{req.master_port or DEFAULT_RDZV_PORT}", f"--rdzv_id={RDZV_ID}"]
        command.append(f"--max_restarts={req.max_restarts}")
        return command + list(req.extra_args) + _program_args(req.program)

    def describe(self, req: LaunchRequest) -> str:
        if req.hosts and not is_single_local_host(req):
            return ssh_fanout.describe(ssh_fanout.torchrun_commands(req))
        return super().describe(req)

    def run(self, req: LaunchRequest) -> int:
        if req.hosts and not is_single_local_host(req):
            return ssh_fanout.run("torchrun", req, ssh_fanout.torchrun_commands, self.reading)
        if req.num_nodes > 1:
            raise LaunchError(
                f"torchrun on {req.num_nodes} nodes without a host list: run the --dry-run command on each "
                f"node, or give the hosts with -H/--hostfile (polytrain then starts them over ssh)"
            )
        return super().run(req)


LAUNCHER = TorchrunLauncher()
