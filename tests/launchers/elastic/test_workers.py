"""Starting workers: a remote one goes through ssh and `ssh_guard` with its variables on stdin, never on a command
line; ending its ssh stops it. Here "ssh" is a stand-in that runs the remote command on this host."""

import os
import subprocess
import sys
import time

import pytest

from polytrain.launchers.elastic.workers import is_local, start_local, start_remote

pytestmark = pytest.mark.timeout(60)


def test_local_hosts():
    assert is_local("localhost") and is_local("127.0.0.1")
    assert not is_local("host.invalid")


def _fake_ssh(tmp_path):
    ssh = tmp_path / "ssh"
    # as ssh: the remote side runs apart (a session of its own) and sees its stdin end when the connection goes
    ssh.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/ssh-argv\nshift 3\nexec 3<&0\nsetsid sh -c "$1" <&3 3<&- &\nwait $!\n')
    ssh.chmod(0o755)
    return str(ssh)


def test_remote_worker_gets_its_variables_on_stdin(tmp_path):
    out = tmp_path / "env"
    program = [sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write(os.environ['HOROVOD_RANK'] + "
                                     f"os.environ['POLYTRAIN_ELASTIC_SLOT'] + os.environ['TOKEN_X'])"]
    env = {"HOROVOD_RANK": "3", "POLYTRAIN_ELASTIC_SLOT": "node9:1", "TOKEN_X": "s3cr3t"}
    worker = start_remote("node9:1", "node9", 1, 3, program, env, _fake_ssh(tmp_path))
    worker.proc.wait(timeout=50)
    assert worker.poll() == 0 and worker.stdin_fd is None and worker.name == "node9[1]"
    assert out.read_text() == "3node9:1s3cr3t"
    argv = (tmp_path / "ssh-argv").read_text()
    assert "node9" in argv and "ssh_guard --env-on-stdin" in argv and "s3cr3t" not in argv


def test_killing_a_remote_worker_ends_its_remote_command(tmp_path):
    pidfile = tmp_path / "pid"
    program = [sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                                     f"time.sleep(60)"]
    worker = start_remote("n:0", "n", 0, 0, program, {}, _fake_ssh(tmp_path))
    while not pidfile.exists() or not pidfile.read_text():
        assert worker.poll() is None
        time.sleep(0.05)
    remote_pid = int(pidfile.read_text())
    worker.kill()  # the "ssh" goes; the guard sees its stdin close and stops the command's group
    worker.proc.wait(timeout=30)
    for _ in range(400):
        try:
            os.kill(remote_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the remote command outlived its ssh")


def test_local_worker_is_killed_with_its_group(tmp_path):
    worker = start_local("a:0", "a", 0, 0, ["sh", "-c", "sleep 60 & wait"], dict(os.environ))
    worker.kill()
    worker.proc.wait(timeout=10)
    assert worker.poll() == 128 + 9


def test_local_worker_dies_with_the_driver(tmp_path):
    pidfile = tmp_path / "pid"
    driver = (f"import sys, time; from polytrain.launchers.elastic.workers import start_local; "
              f"w = start_local('a:0', 'a', 0, 0, ['sh', '-c', 'echo $$ > {pidfile}; exec sleep 60'], {{}}); "
              f"time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", driver])
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert proc.poll() is None
        time.sleep(0.05)
    worker_pid = int(pidfile.read_text())
    proc.kill()  # SIGKILL: the driver stops nothing itself
    proc.wait()
    for _ in range(200):
        try:
            os.kill(worker_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(worker_pid, 9)
    pytest.fail("the local worker outlived its driver")
