"""The cluster itself: hosts that resolve each other and have their own names and addresses, real sshd
between them, and nothing left behind by a run that crashed (the next run sweeps it)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import NETNS_ETC, PREFIX, cluster_unavailable, sweep

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

HERE = Path(__file__).resolve().parent


def test_hosts_resolve_each_other_and_ssh_between_them(cluster) -> None:
    for host in cluster.hosts:
        assert host.run(["hostname"]).stdout.strip() == host.name
        for other in cluster.hosts:
            assert host.run(["getent", "hosts", other.name]).stdout.split()[0] == other.addr
        addresses = host.run(["ip", "-4", "-o", "addr", "show"]).stdout
        assert f"inet {host.addr}/24" in addresses and "inet 127.0.0.1/8" in addresses
        assert [(a, p) for a, p in host.listening() if p == 22] == [(host.addr, 22)]  # sshd, on its address only
    h1, h2 = cluster.hosts
    done = h1.run([str(cluster.bin / "ssh"), "h2", "hostname; echo $SSH_CONNECTION"])
    name, connection = done.stdout.splitlines()
    assert name == "h2" and connection.split()[0] == h1.addr and connection.split()[2] == h2.addr


def test_a_crashed_run_is_swept_by_the_next(tmp_path: Path) -> None:
    why = cluster_unavailable()
    if why:
        pytest.skip(why)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from netns import Cluster; "
            "c = Cluster(1, sys.argv[2]).start(); print(c.tag, c.hosts[0].sshd.pid, flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code, str(HERE), str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        tag, sshd = child.stdout.readline().split()
    finally:
        child.send_signal(signal.SIGKILL)  # no atexit, no teardown
        child.wait(timeout=30)
    assert tag == f"{PREFIX}{child.pid}"
    assert f"{tag}h1" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = sweep()
    assert f"{tag}h1" in removed and f"{tag}br" in removed
    assert f"{tag}h1" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert tag not in links
    assert not (NETNS_ETC / f"{tag}h1").exists()
    deadline = time.monotonic() + 30  # the sshd is killed; a zombie until init reaps it
    while running(int(sshd)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(int(sshd))


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
