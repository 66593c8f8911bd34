"""The remote end of the ssh fan-out, with real processes on this host: it forwards the exit code, writes the
hostfile it is given, and when its stdin (the ssh connection) closes stops the whole command, grandchildren
included."""

from __future__ import annotations

import os
import subprocess
import sys

GUARD = [sys.executable, "-m", "polytrain.launchers.ssh_guard"]


def guarded(*args: str, first: bytes = b"") -> subprocess.CompletedProcess:
    """The guard with a stdin kept open (as an ssh connection is) until it exits; ``first`` is written to it
    before the guard starts."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, first)
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


def test_variables_come_from_the_first_line_of_stdin_and_the_connection_is_still_watched() -> None:
    """What the fan-out sends (``ssh_fanout.env_payload``) reaches the command's environment."""
    from polytrain.launchers.ssh_fanout import ENV_ON_STDIN, env_payload

    payload = env_payload({"POLYTRAIN_TEST_SECRET": "s3 cr3t", "OTHER": "x"})
    done = guarded(ENV_ON_STDIN, "--", "sh", "-c", 'printf "%s|%s" "$POLYTRAIN_TEST_SECRET" "$OTHER"', first=payload)
    assert (done.returncode, done.stdout) == (0, "s3 cr3t|x")
    done = guarded(ENV_ON_STDIN, "--hostfile-text", "h1 slots=1\n", "--", "cat", "{hostfile}", first=payload)
    assert (done.returncode, done.stdout) == (0, "h1 slots=1\n")


def test_a_bad_line_of_variables_is_one_line_and_exit_code_2() -> None:
    done = guarded("--env-on-stdin", "--", "true", first=b"[1, 2]\n")
    assert done.returncode == 2
    assert done.stderr == "polytrain ssh_guard: the first line of stdin is not a JSON object of strings\n"
    done = subprocess.run([*GUARD, "--env-on-stdin", "--", "true"], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, "polytrain ssh_guard: stdin ended before the line of variables\n")


def test_usage_without_a_command() -> None:
    done = subprocess.run([*GUARD, "--"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("usage: ")
