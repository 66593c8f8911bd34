"""Starting and stopping the elastic driver's workers: local processes, or over ssh under `ssh_guard`.

A host is local when its name resolves to an address of this machine (``localhost`` and ``127.0.0.1`` are two
hosts for the driver, both local, as in Horovod's tests). A local worker runs in a session of its own, so that
stopping it stops everything it started. A remote worker is ``ssh HOST ... ssh_guard --env-on-stdin -- COMMAND``:
its variables travel on the connection's stdin, never on a command line, and the guard stops the worker's
whole process group when the connection closes (the driver stopped that ssh, or died).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from polytrain.comm import net
from polytrain.launchers.base import local_host_names
from polytrain.launchers.processes import exit_code
from polytrain.launchers.ssh_fanout import HostCommand, env_payload, ssh_command, stdin_pipe


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine: a name of it, or a name resolving to an address a socket can bind here."""
    if host in local_host_names():
        return True
    return any(net.is_local_address(address) for address in net.addresses_of(host))


@dataclasses.dataclass
class Worker:
    """One worker process (for a remote host: its ssh) and the slot it was started for."""

    key: str
    host: str
    local_rank: int
    rank_at_spawn: int
    proc: subprocess.Popen
    stdin_fd: int | None = None  # the write end of a remote worker's stdin: open while it should run
    code: int | None = None
    killed: bool = False

    @property
    def name(self) -> str:
        return f"{self.host}[{self.local_rank}]"

    def poll(self) -> int | None:
        """The exit code once it ended (128+N when killed by signal N), else None."""
        if self.code is None:
            returncode = self.proc.poll()
            if returncode is not None:
                self.code = exit_code(returncode)
                self._close()
        return self.code

    def kill(self) -> None:
        """SIGKILL its process group (local), or end its ssh (the remote guard then kills it)."""
        self.killed = True
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._close()

    def _close(self) -> None:
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None


def _die_with_driver() -> None:
    """In the child before exec (Linux): SIGKILL it when the driver dies, even by SIGKILL, which leaves no
    chance to stop the workers' sessions."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_local(key: str, host: str, local_rank: int, rank: int, command: Sequence[str],
                env: Mapping[str, str]) -> Worker:
    """``command`` here, in a session of its own (killed with it), dying with the driver."""
    proc = subprocess.Popen(list(command), env=dict(env), start_new_session=True, stdin=subprocess.DEVNULL,
                            preexec_fn=_die_with_driver if sys.platform == "linux" else None)
    return Worker(key, host, local_rank, rank, proc)


def start_remote(key: str, host: str, local_rank: int, rank: int, command: Sequence[str],
                 env: Mapping[str, str], ssh: str) -> Worker:
    """``command`` on ``host`` over ssh, with ``env`` sent on stdin (the guard adds it to its own)."""
    read_end, write_end = stdin_pipe(env_payload(env))
    try:
        proc = subprocess.Popen(ssh_command(HostCommand(host, 0, tuple(command), env), ssh=ssh),
                                stdin=read_end, start_new_session=True)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return Worker(key, host, local_rank, rank, proc, stdin_fd=write_end)
