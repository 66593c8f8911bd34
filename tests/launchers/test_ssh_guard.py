"""The remote end of the ssh fan-out, with real processes on this host: it forwards the exit code, writes the
hostfile it is given, and when its stdin (the ssh connection) closes stops the whole command, grandchildren
included."""

from __future__ import annotations

import os
import subprocess
import sys

GUARD = [sys.executable, "-m", "polytrain.launchers.ssh_guard"]


def guarded(*args: str) -> subprocess.CompletedProcess:
    """The guard with a stdin kept open (as an ssh connection is) until it exits."""
    read_end, write_end = os.pipe()
    try:
        return subprocess.run([*GUARD, *args], stdin=read_end, capture_output=True, text=True, timeout=60)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_exit_code_is_forwarded() -> None:
    assert guarded("--", "sh", "-c", "exit 3").returncode == 3


def test_hostfile_text_is_written_where_the_command_says() -> None:
    done = guarded("--hostfile-text", "h1 slots=2\nh2 slots=2\n", "--", "cat", "{hostfile}")
    assert done.returncode == 0 and done.stdout == "h1 slots=2\nh2 slots=2\n"


def test_closed_stdin_stops_the_command_and_its_children() -> None:
    guard = subprocess.Popen([*GUARD, "--", "sh", "-c", "sleep 300 & echo $!; wait"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(guard.stdout.readline())
        os.kill(grandchild, 0)  # running
        guard.stdin.close()  # the ssh connection is gone
        assert guard.wait(timeout=60) == 128 + 15  # stopped with SIGTERM
        try:
            os.kill(grandchild, 0)
            alive = open(f"/proc/{grandchild}/stat").read().split()[2] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            alive = False
        assert not alive
    finally:
        guard.kill()
        guard.wait()


def test_usage_without_a_command() -> None:
    done = subprocess.run([*GUARD, "--"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("usage: ")
