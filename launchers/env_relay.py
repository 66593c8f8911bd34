"""``python -m polytrain.launchers.env_relay FILE -- PROGRAM...``: PROGRAM with the variables FILE holds.

For a launcher that would put the values of ``-x`` variables on a command line itself. Real horovodrun's gloo
mode writes its whole environment into each rank's command (``sh -c 'VAR=value ... PROGRAM'``, and the ``ssh``
command for ranks on other hosts), where any user of the host reads it in ``/proc/<pid>/cmdline`` while the
job runs. polytrain hands horovodrun a private file instead (mode 0600 in a 0700 directory, JSON, removed after
the run) and puts this relay in front of the program: each rank reads the file, adds the variables to its
environment and execs PROGRAM. Ranks on other hosts read the same path, so there it needs the working
directory shared between the hosts (Horovod runs every rank in it); a rank that cannot read the file stops
with a line saying so.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from polytrain.errors import LaunchError

MODULE = "polytrain.launchers.env_relay"
FILE_NAME = "env.json"


@contextmanager
def env_file(env: Mapping[str, str], directory: str | None = None) -> Iterator[Path]:
    """A 0600 file holding ``env`` in a fresh 0700 directory (under ``directory``, or the temporary one),
    removed with the directory afterwards."""
    try:
        folder = Path(tempfile.mkdtemp(prefix=".polytrain-env-", dir=directory))
    except OSError as exc:
        where = directory or tempfile.gettempdir()
        raise LaunchError(f"cannot make a private directory in {where} for the -x variables "
                          f"({exc.strerror or exc})") from exc
    path = folder / FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(dict(env), out)
        yield path
    finally:
        path.unlink(missing_ok=True)
        folder.rmdir()


def relayed(path: str | os.PathLike[str], program: Sequence[str]) -> tuple[str, ...]:
    """``program`` behind the relay that reads ``path`` first."""
    return (sys.executable, "-m", MODULE, str(path), "--", *program)


def read_env(path: str) -> dict[str, str]:
    try:
        with open(path) as source:
            env = json.load(source)
    except OSError as exc:
        raise LaunchError(f"cannot read the -x variables from {path} on host {socket.gethostname()} "
                          f"({exc.strerror or exc}): ranks on other hosts read them from the working "
                          f"directory, which must be shared between the hosts") from exc
    except ValueError as exc:
        raise LaunchError(f"{path} does not hold the -x variables as JSON ({exc})") from exc
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise LaunchError(f"{path} does not hold the -x variables as a JSON object of strings")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print(f"usage: python -m {MODULE} FILE -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    try:
        os.environ.update(read_env(args[0]))
    except LaunchError as exc:
        print(f"polytrain: {exc}", file=sys.stderr)
        return 2
    try:
        os.execvp(args[2], args[2:])
    except OSError as exc:
        print(f"polytrain: cannot run {args[2]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
