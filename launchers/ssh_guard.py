"""The remote end of `ssh_fanout`: ``python -m polytrain.launchers.ssh_guard [--hostfile-text TEXT] -- COMMAND``.

Runs COMMAND (a per-node launcher) in a session of its own and watches stdin, which is the ssh connection:
when it closes — the launching host stopped this ssh, died, or the connection broke — the command's whole
process group gets SIGTERM, then SIGKILL (`processes.supervise`), so nothing outlives the job on this host.
Exits with the command's exit code. ``--hostfile-text`` writes a hostfile here and puts its path where
COMMAND says ``{hostfile}``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

from polytrain.launchers.processes import supervise

HOSTFILE_ARG = "{hostfile}"


def _stop_on_eof() -> None:
    """Read stdin until it ends, then SIGTERM this process (supervise forwards it to the command's group)."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def guard(command: Sequence[str], hostfile_text: str | None = None) -> int:
    """Run ``command`` until it ends or stdin closes; returns its exit code (128+N when stopped by signal N)."""
    with tempfile.TemporaryDirectory(prefix="polytrain-ssh-") as tmp:
        if hostfile_text is not None:
            path = os.path.join(tmp, "hostfile")
            with open(path, "w") as out:
                out.write(hostfile_text)
            command = [path if arg == HOSTFILE_ARG else arg for arg in command]
        threading.Thread(target=_stop_on_eof, daemon=True).start()
        return supervise([list(command)], [dict(os.environ)], stdin=subprocess.DEVNULL).code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args or not args[args.index("--") + 1:]:
        print("usage: python -m polytrain.launchers.ssh_guard [--hostfile-text TEXT] -- COMMAND...", file=sys.stderr)
        return 2
    options, command = args[:args.index("--")], args[args.index("--") + 1:]
    text = options[1] if options[:1] == ["--hostfile-text"] and len(options) == 2 else None
    return guard(command, text)


if __name__ == "__main__":
    sys.exit(main())
