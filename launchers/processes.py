"""Start a group of processes on this host and watch over them until all have ended.

Each process starts in its own session (so its own process group): a signal for
the group reaches the worker and anything it started. The rules:

- the first non-zero exit code is the group's exit code (death by signal N is 128+N);
- when one process fails, the others get SIGTERM, then SIGKILL after a grace period;
- SIGINT/SIGTERM sent to this process are forwarded to every group; whoever is
  still running ``grace`` seconds later gets SIGTERM, then SIGKILL;
- when a process has exited, its group is swept with SIGKILL before it is reaped,
  so no grandchild outlives the job. (While unreaped, the exited process keeps its
  pid and group id reserved, so the sweep cannot hit an unrelated process.)

What is said about a failure is the caller's: ``on_failure`` gets every process's
return code (Popen's: -N for signal N, None while running) once one has failed.
``stdin``/``stdout``/``stderr`` (file descriptors) replace the ones the processes inherit; ``stdin`` may also
be one descriptor per command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from polytrain.errors import LaunchError

GRACE_SECONDS = 5.0
POLL_SECONDS = 0.05


class Outcome(NamedTuple):
    code: int
    signal: int | None  # the signal this process received and forwarded, if any


def exit_code(returncode: int) -> int:
    """Popen's ``-N`` (killed by signal N) as a shell would report it: ``128 + N``."""
    return 128 - returncode if returncode < 0 else returncode


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_if_exited(proc: subprocess.Popen) -> int | None:
    """Return code if ``proc`` has exited (sweeping its group first), else None."""
    if proc.returncode is not None:
        return proc.returncode
    if hasattr(os, "waitid"):
        try:
            state = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            state = True  # already reaped elsewhere; poll() below picks up the code
        if state is None:
            return None
        _killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
    code = proc.poll()
    if code is not None:
        _killpg(proc.pid, signal.SIGKILL)
    return code


def _terminate(procs: Sequence[subprocess.Popen], grace: float) -> None:
    for proc in procs:
        if proc.returncode is None:
            _killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if all(_reap_if_exited(proc) is not None for proc in procs):
            return
        time.sleep(POLL_SECONDS)
    for proc in procs:
        if proc.returncode is None:
            _killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


@contextmanager
def _forwarding(procs: list[subprocess.Popen], received: list[int],
                forward_as: Mapping[int, int] | None = None) -> Iterator[None]:
    """While inside, SIGINT/SIGTERM go to every still-running group instead of killing us (as the signal
    ``forward_as`` maps them to, where it does)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for proc in procs:
            if proc.returncode is None:
                _killpg(proc.pid, (forward_as or {}).get(signum, signum))

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def supervise(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    *,
    grace: float = GRACE_SECONDS,
    on_failure: Callable[[Sequence[int | None]], None] | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    stdin: int | Sequence[int] | None = None,
    forward_as: Mapping[int, int] | None = None,
) -> Outcome:
    """Run ``commands[i]`` with environment ``envs[i]`` concurrently; see the module doc."""
    if len(commands) != len(envs):
        raise ValueError("supervise needs one environment per command")
    stdins = list(stdin) if isinstance(stdin, Sequence) else [stdin] * len(commands)
    if len(stdins) != len(commands):
        raise ValueError("supervise needs one stdin per command")
    procs: list[subprocess.Popen] = []
    received: list[int] = []
    with _forwarding(procs, received, forward_as):
        try:
            for command, env, command_stdin in zip(commands, envs, stdins):
                if received:
                    break
                try:
                    procs.append(subprocess.Popen(list(command), env=dict(env), start_new_session=True,
                                                  stdin=command_stdin, stdout=stdout, stderr=stderr))
                except OSError as exc:
                    raise LaunchError(f"cannot start {command[0]!r}: {exc.strerror or exc}") from exc
            code, signalled_at = 0, None
            while True:
                codes = [_reap_if_exited(proc) for proc in procs]
                code = next((exit_code(c) for c in codes if c), 0)
                if code and not received and on_failure is not None:
                    on_failure(codes)
                if code or all(c is not None for c in codes):
                    break
                if received and signalled_at is None:
                    signalled_at = time.monotonic()
                if signalled_at is not None and time.monotonic() - signalled_at > grace:
                    break  # a worker ignores the forwarded signal: _terminate escalates
                time.sleep(POLL_SECONDS)
        finally:
            _terminate(procs, grace)
    signum = received[0] if received else None
    if signum is not None and code == 0:
        code = 128 + signum
    return Outcome(code, signum)
