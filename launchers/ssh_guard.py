"""The remote end of `ssh_fanout`: ``python -m polytrain.launchers.ssh_guard [--env-on-stdin] [--hostfile-text TEXT]
-- COMMAND``.

Runs COMMAND (a per-node launcher) in a session of its own and watches stdin, which is the ssh connection:
when it closes — the launching host stopped this ssh, died, or the connection broke — the command's whole
process group gets SIGTERM, then SIGKILL (`processes.supervise`), so nothing outlives the job on this host.
Exits with the command's exit code. ``--env-on-stdin``: the first line of stdin is a JSON object of the
variables COMMAND gets (sent there rather than on the ssh command line, which every user of both hosts can
read). ``--hostfile-text`` writes a hostfile here and puts its path where COMMAND says ``{hostfile}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence

from polytrain.launchers.processes import supervise

HOSTFILE_ARG = "{hostfile}"
ENV_ON_STDIN = "--env-on-stdin"
USAGE = "usage: python -m polytrain.launchers.ssh_guard [--env-on-stdin] [--hostfile-text TEXT] -- COMMAND..."


def read_env_line(fd: int = 0) -> dict[str, str]:
    """The variables on the first line of ``fd`` (a JSON object of strings); ValueError when there is none."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(fd, 65536)
        if not chunk:
            raise ValueError("stdin ended before the line of variables")
        data += chunk
    env = json.loads(data.split(b"\n", 1)[0])
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("the first line of stdin is not a JSON object of strings")
    return env


def _stop_on_eof() -> None:
    """Read stdin until it ends, then SIGTERM this process (supervise forwards it to the command's group)."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def guard(command: Sequence[str], hostfile_text: str | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` (with ``env`` added to this process's environment) until it ends or stdin closes;
    returns its exit code (128+N when stopped by signal N)."""
    with tempfile.TemporaryDirectory(prefix="polytrain-ssh-") as tmp:
        if hostfile_text is not None:
            path = os.path.join(tmp, "hostfile")
            with open(path, "w") as out:
                out.write(hostfile_text)
            command = [path if arg == HOSTFILE_ARG else arg for arg in command]
        threading.Thread(target=_stop_on_eof, daemon=True).start()
        return supervise([list(command)], [{**os.environ, **(env or {})}], stdin=subprocess.DEVNULL).code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args or not args[args.index("--") + 1:]:
        print(USAGE, file=sys.stderr)
        return 2
    options, command = args[:args.index("--")], args[args.index("--") + 1:]
    env = None
    if options[:1] == [ENV_ON_STDIN]:
        options = options[1:]
        try:
            env = read_env_line()
        except (OSError, ValueError) as exc:
            print(f"polytrain ssh_guard: {exc}", file=sys.stderr)
            return 2
    if options and (options[0] != "--hostfile-text" or len(options) != 2):
        print(USAGE, file=sys.stderr)
        return 2
    return guard(command, options[1] if options else None, env)


if __name__ == "__main__":
    sys.exit(main())
