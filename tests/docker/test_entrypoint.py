"""docker/entrypoint.sh run for real, outside a container, against this venv.

What the image relies on: arguments go to ``polytrain`` unless they name one of
the pass-through commands; a mounted key directory becomes a strict ~/.ssh; and
``sshd`` serves sessions that see the venv on PATH (mpirun starts its remote
daemons through exactly such a session). The sshd test runs when OpenSSH's
server is installed (apt-get install openssh-server) and skips otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from procs import BIN, REPO, check, free_port, run

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
NOTHING = ("python", "-c", "pass")  # a pass-through command that does nothing


def entry_env(home: Path, keys: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYTRAIN_SSH")}
    env.update(HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               POLYTRAIN_SSH_KEYS=str(keys or home / "no-keys"), **extra)
    return env


def make_keys(directory: Path, host_key: bool = False) -> Path:
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed (apt-get install openssh-client)")
    directory.mkdir(mode=0o700)
    names = ["id_ed25519"] + (["ssh_host_ed25519_key"] if host_key else [])
    for name in names:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)],
                       check=True, timeout=30)
    return directory


def test_arguments_go_to_polytrain(tmp_path: Path) -> None:
    result = check(run(["bash", str(ENTRYPOINT), "info", "--json"], env=entry_env(tmp_path), timeout=120))
    report = json.loads(result.stdout)
    assert "torch" in json.dumps(report)
    usage = check(run(["bash", str(ENTRYPOINT), "--help"], env=entry_env(tmp_path), timeout=60))
    assert usage.stdout.startswith("usage: polytrain")


def test_pass_through_commands_run_as_given(tmp_path: Path) -> None:
    result = check(run(["bash", str(ENTRYPOINT), "python", "-c", "import sys; print(6 * 7, sys.prefix)"],
                       env=entry_env(tmp_path), timeout=60))
    answer, prefix = result.stdout.split()
    assert answer == "42" and Path(prefix) == BIN.parent.absolute()
    assert not (tmp_path / ".ssh").exists()  # no key directory, nothing installed


def test_mounted_keys_become_a_private_ssh_config(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    (keys / "id_ed25519").chmod(0o644)  # as a host mount often has it; ssh would refuse it
    home = tmp_path / "home"
    home.mkdir()
    check(run(["bash", str(ENTRYPOINT), *NOTHING], env=entry_env(home, keys, POLYTRAIN_SSH_PORT="2345"), timeout=30))
    ssh = home / ".ssh"
    assert stat.S_IMODE(ssh.stat().st_mode) == 0o700
    assert stat.S_IMODE((ssh / "id_ed25519").stat().st_mode) == 0o600
    assert (ssh / "id_ed25519").read_text() == (keys / "id_ed25519").read_text()
    assert (ssh / "authorized_keys").read_text() == (keys / "id_ed25519.pub").read_text()
    config = (ssh / "config").read_text().split("\n")
    assert "    Port 2345" in config
    assert f"    IdentityFile {ssh / 'id_ed25519'}" in config
    assert "    StrictHostKeyChecking accept-new" in config


def test_a_shared_host_key_makes_host_checking_strict(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys", host_key=True)
    home = tmp_path / "home"
    home.mkdir()
    check(run(["bash", str(ENTRYPOINT), *NOTHING], env=entry_env(home, keys), timeout=30))
    host_public = (keys / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    assert (home / ".ssh" / "known_hosts").read_text() == f"* {' '.join(host_public)}\n"
    assert "    StrictHostKeyChecking yes" in (home / ".ssh" / "config").read_text().split("\n")
    assert "    Port 2222" in (home / ".ssh" / "config").read_text().split("\n")


@pytest.mark.parametrize(("variables", "message"), [
    ({"POLYTRAIN_SSH_PORT": "22x"}, "POLYTRAIN_SSH_PORT must be a port number, got '22x'"),
    ({}, "no id_* key in"),
])
def test_bad_ssh_settings_are_one_line_errors(tmp_path: Path, variables: dict[str, str], message: str) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    if variables:
        make_keys(tmp_path / "real-keys")
        keys = tmp_path / "real-keys"
    result = run(["bash", str(ENTRYPOINT), *NOTHING], env=entry_env(tmp_path, keys, **variables), timeout=30)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"polytrain-entrypoint: {message}")


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"sshd exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"sshd did not listen on port {port} within {timeout}s")


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_sshd_sessions_see_the_venv(tmp_path: Path) -> None:
    if not Path("/usr/sbin/sshd").exists() or shutil.which("ssh") is None:
        pytest.skip("OpenSSH server/client not installed (apt-get install openssh-server openssh-client)")
    if os.geteuid() == 0 and not Path("/run/sshd").is_dir():
        pytest.skip("sshd started as root needs /run/sshd (the images create it): mkdir -p /run/sshd")
    # sshd's StrictModes refuses keys under a world-writable directory such as /tmp.
    base = Path(tempfile.mkdtemp(prefix="polytrain-sshd-", dir=Path.home()))
    try:
        keys = make_keys(base / "keys")
        home = base / "home"
        home.mkdir(mode=0o700)
        port = free_port()
        env = entry_env(home, keys, POLYTRAIN_SSH_PORT=str(port), POLYTRAIN_SSH_ENV="PT_PROBE",
                        PT_PROBE="seen", POLYTRAIN_VENV=str(BIN.parent))
        sshd = subprocess.Popen(["bash", str(ENTRYPOINT), "sshd"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            wait_for_port(port, sshd)
            probe = 'command -v prted; echo "venv=$POLYTRAIN_VENV probe=$PT_PROBE"'
            result = check(run(["ssh", "-F", str(home / ".ssh" / "config"), "127.0.0.1", probe],
                               env=env, timeout=30))
        finally:
            os.killpg(sshd.pid, signal.SIGKILL)
            sshd.wait(timeout=10)
        assert result.stdout.split() == [str(BIN / "prted"), f"venv={BIN.parent}", "probe=seen"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
