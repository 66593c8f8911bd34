"""A small real cluster on one Linux machine: hosts are network namespaces on a bridge, each with its own sshd.

Reusable outside pytest (benches): no pytest import here. Needs root (``CAP_NET_ADMIN``) and OpenSSH
(``openssh-server``); `cluster_unavailable` says why not when they are missing.

Layout of one run (``tag`` = ``ptc<pid>``, so two runs on one machine never clash):

- a bridge ``<tag>br`` in the root namespace, with no address: traffic flows only between the hosts;
- host ``hN`` = namespace ``<tag>hN``, a veth pair ``<tag>hN`` (root side, on the bridge) / ``eth0`` (inside),
  address ``10.77.<pid % 250 + 1>.N/24``, loopback up, its own UTS namespace (``hostname`` says ``hN``);
- ``/etc/netns/<tag>hN/hosts`` names every host (``ip netns exec`` bind-mounts it over ``/etc/hosts``);
- one real ``sshd`` per host on ``<addr>:22``: key-only root login with a per-run ed25519 key, host keys,
  config and logs under ``workdir``;
- the client side: ``workdir/ssh_config`` plus a wrapper ``workdir/bin/ssh`` (``ssh -F ssh_config "$@"``);
  `Cluster.env` puts that directory first on PATH and names it in ``OMPI_MCA_plm_rsh_agent``, so mpirun,
  horovodrun and polytrain's fan-out all reach the hosts with it. ``~/.ssh`` is never touched.

The filesystem is shared (like an NFS home on a real cluster): the venv and the repository have the same
paths on every host. Teardown (``stop``, also at exit) kills every process in the namespaces and removes
namespaces, bridge, ``/etc/netns`` entries; `sweep` removes what crashed earlier runs left.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hostnet import ClusterUnavailable, HostNetwork

PREFIX = "ptc"
SSHD = "/usr/sbin/sshd"
NETNS_ETC = Path("/etc/netns")
VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
_CLEARED = ("OMPI_", "PMI", "PMIX_", "SLURM_", "HOROVOD_", "TORCHELASTIC_", "PRTE_", "MPICH_", "HYDRA_")
_CLEARED_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(netns: str) -> list[int]:
    done = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _remove_netns(netns: str) -> None:
    for _ in range(50):  # processes may still be forking while we kill: repeat until none is left
        pids = _netns_pids(netns)
        if not pids:
            break
        _kill_pids(pids)
        time.sleep(0.05)
    _ip("netns", "del", netns, check=False)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def sweep(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces, bridges and /etc/netns entries left by runs whose process is gone; returns their names."""
    removed = []
    names = {line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()}
    if NETNS_ETC.is_dir():
        names |= {entry.name for entry in NETNS_ETC.iterdir()}
    links = _ip("-o", "link", "show", check=False).stdout.splitlines()
    names |= {line.split(":")[1].strip().split("@")[0] for line in links if line.count(":") >= 2}
    for name in sorted(names):
        if not name.startswith(prefix):
            continue
        digits = "".join(ch for ch in name[len(prefix):].split("h")[0].split("b")[0] if ch.isdigit())
        if not digits or _alive(int(digits)):
            continue
        if (Path("/run/netns") / name).exists() or (NETNS_ETC / name).exists():
            _remove_netns(name)
        _ip("link", "del", name, check=False)
        removed.append(name)
    return removed


def cluster_unavailable() -> str | None:
    """Why a cluster cannot be made here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", "tc", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install iproute2 openssh-client)"
    if not os.path.exists(SSHD):
        return f"{SSHD} not found (apt-get install openssh-server)"
    probe = f"{PREFIX}{os.getpid()}probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode:
        return f"cannot create a network namespace (needs root / CAP_NET_ADMIN): {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Host(HostNetwork):
    """One host of the cluster: a namespace with an address, its own hostname and an sshd."""

    def __init__(self, cluster: Cluster, index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"h{index}"
        self.netns = f"{cluster.tag}h{index}"
        self.veth = f"{cluster.tag}h{index}"  # root side; inside the namespace it is "eth0"
        self.interface = "eth0"
        self.addr = f"{cluster.subnet}.{index}"
        self.dir = cluster.workdir / self.name
        self.sshd: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.addr}, netns={self.netns})"

    def prefix(self) -> list[str]:
        """The command prefix that runs a program on this host (its network, /etc/hosts and hostname)."""
        base = ["ip", "netns", "exec", self.netns]
        if self.sshd is not None and self.sshd.poll() is None:
            return [*base, "nsenter", f"--uts=/proc/{self.sshd.pid}/ns/uts", "--"]
        return base

    def run(self, cmd: Sequence[str], timeout: float = 120, env: Mapping[str, str] | None = None,
            check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run ``cmd`` on this host and wait (text output captured unless ``stdout``/``stderr`` are given)."""
        kw.setdefault("capture_output", "stdout" not in kw and "stderr" not in kw)
        return subprocess.run([*self.prefix(), *cmd], timeout=timeout, check=check, text=True,
                              env=dict(env) if env is not None else None, **kw)

    def popen(self, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` on this host (in a session of its own unless told otherwise)."""
        kw.setdefault("start_new_session", True)
        if kw.get("env") is not None:
            kw["env"] = dict(kw["env"])
        return subprocess.Popen([*self.prefix(), *cmd], **kw)

    def pids(self) -> list[int]:
        """Every process in this host's namespace (sshd included)."""
        return _netns_pids(self.netns)

    def job_pids(self) -> list[int]:
        """The processes on this host other than its sshd listener."""
        keep = {self.sshd.pid} if self.sshd is not None else set()
        return [pid for pid in self.pids() if pid not in keep]

    def commands(self, pids: Sequence[int] | None = None) -> dict[int, str]:
        found = {}
        for pid in self.job_pids() if pids is None else pids:
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
        return found

    def kill_all(self, pattern: str = "") -> list[int]:
        """SIGKILL this host's job processes whose command line contains ``pattern`` (all but sshd for "")."""
        victims = [pid for pid, cmd in self.commands().items() if pattern in cmd]
        _kill_pids(victims)
        return victims

    def link_down(self) -> None:
        """Cut this host's cable: its bridge-side veth goes down (both ends lose carrier, sockets stay open)."""
        _ip("link", "set", self.veth, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.veth, "up")


class Cluster:
    """``n_hosts`` namespaces on a bridge, each with sshd; ``with Cluster(2, workdir) as c: c.hosts[0].run(...)``."""

    def __init__(self, n_hosts: int = 2, workdir: Path | str | None = None, *, tag: str | None = None) -> None:
        if not 1 <= n_hosts <= 200:
            raise ValueError("n_hosts must be in 1..200")
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        self.n_hosts = n_hosts
        self.workdir = Path(workdir or f"/tmp/{self.tag}").resolve()
        self.subnet = f"10.77.{os.getpid() % 250 + 1}"
        self.bridge = f"{self.tag}br"
        self.hosts = [Host(self, i) for i in range(1, n_hosts + 1)]
        self.key = self.workdir / "id_ed25519"
        self.ssh_config = self.workdir / "ssh_config"
        self.bin = self.workdir / "bin"
        self.started = False

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    # --- bring-up -------------------------------------------------------------------------------------
    def start(self) -> Cluster:
        why = cluster_unavailable()
        if why:
            raise ClusterUnavailable(why)
        sweep()
        atexit.register(self.stop)
        self.started = True
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            self._network()
            self._ssh_files()
            for host in self.hosts:
                self._start_sshd(host)
            self.wait_ssh()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        hosts_text = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n" + "".join(
            f"{h.addr} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            (NETNS_ETC / h.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / h.netns / "hosts").write_text(hosts_text)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", f"{h.veth}p")
            _ip("link", "set", f"{h.veth}p", "netns", h.netns)
            _ip("link", "set", h.veth, "master", self.bridge)
            _ip("link", "set", h.veth, "up")
            inside = ["-n", h.netns]
            _ip(*inside, "link", "set", f"{h.veth}p", "name", h.interface)
            _ip(*inside, "addr", "add", f"{h.addr}/24", "dev", h.interface)
            _ip(*inside, "link", "set", h.interface, "up")
            _ip(*inside, "link", "set", "lo", "up")

    def _ssh_files(self) -> None:
        if not self.key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.tag, "-f", str(self.key)],
                           check=True, capture_output=True, timeout=60)
        (self.workdir / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        self.ssh_config.write_text("\n".join([
            "Host *",
            "  User root",
            f"  IdentityFile {self.key}",
            "  IdentitiesOnly yes",
            "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null",
            "  GlobalKnownHostsFile /dev/null",
            "  LogLevel ERROR",
            "  BatchMode yes",
            "  ConnectTimeout 10",
            "  ServerAliveInterval 10",  # a dead link ends the ssh client after ~30 s
            "  ServerAliveCountMax 3",
            "",
        ]))
        self.bin.mkdir(exist_ok=True)
        wrapper = self.bin / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {shlex.quote(str(self.ssh_config))} "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory

    def _start_sshd(self, host: Host) -> None:
        host.dir.mkdir(parents=True, exist_ok=True)
        hostkey = host.dir / "ssh_host_ed25519_key"
        if not hostkey.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)],
                           check=True, capture_output=True, timeout=60)
        config = host.dir / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {host.addr}:22",
            f"HostKey {hostkey}",
            f"PidFile {host.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "X11Forwarding no",
            "PrintMotd no",
            "AcceptEnv LANG LC_* POLYTRAIN_*",
            "ClientAliveInterval 5",  # ... and the session on the far side after ~15 s (its guard then stops the job)
            "ClientAliveCountMax 3",
            "MaxStartups 200",
            "MaxSessions 200",
            "LogLevel ERROR",
            "",
        ]))
        log = host.dir / "sshd.log"
        # own UTS namespace: `hostname` is the host's name in every session (Open MPI and Horovod tell nodes
        # apart by it); `ip netns exec` gives the namespace and its /etc/hosts.
        script = f"hostname {host.name} && exec {SSHD} -D -e -f {shlex.quote(str(config))}"
        host.sshd = subprocess.Popen(["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", script],
                                     stdout=subprocess.DEVNULL, stderr=open(log, "ab"), start_new_session=True)

    def wait_ssh(self, timeout: float = 60) -> None:
        """Wait until every host answers ``ssh <host> hostname`` with its own name, from the first host."""
        deadline = time.monotonic() + timeout
        pending = list(self.hosts)
        last = ""
        while pending:
            host = pending[0]
            if host.sshd is not None and host.sshd.poll() is not None:
                raise ClusterUnavailable(f"sshd on {host.name} exited: {(host.dir / 'sshd.log').read_text()[-500:]}")
            done = self.hosts[0].run([str(self.bin / "ssh"), host.name, "hostname"], check=False, timeout=30)
            if done.returncode == 0 and done.stdout.strip() == host.name:
                pending.pop(0)
                continue
            last = (done.stderr or done.stdout).strip()
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"ssh to {host.name} did not work within {timeout:.0f}s: {last}")
            time.sleep(0.2)

    # --- use ------------------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The environment a launcher on a host needs: the ssh wrapper and the venv first on PATH, Open MPI
        told to use the wrapper and allowed to run as root, one thread per rank; no network pinning (the
        job must find the hosts' interface itself), no rank variables inherited from this process."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEARED) and k not in _CLEARED_KEYS}
        path = os.pathsep.join([str(self.bin), str(VENV_BIN), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
                                "/usr/bin", "/sbin", "/bin"])
        env.update(
            PATH=path, OMPI_MCA_plm_rsh_agent=str(self.bin / "ssh"), OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PRTE_MCA_plm_rsh_agent=str(self.bin / "ssh"),
            HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(self.bin / "ssh"),
            OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
        )
        env.update(extra)
        return env

    def hostlist(self, slots: int = 1, n: int | None = None) -> str:
        """``h1:S,h2:S,...`` for the first ``n`` hosts."""
        return ",".join(f"{h.name}:{slots}" for h in self.hosts[: n or len(self.hosts)])

    def leftovers(self) -> dict[str, dict[int, str]]:
        """Job processes still alive on each host (sshd listeners excluded)."""
        return {h.name: cmds for h in self.hosts if (cmds := h.commands())}

    def kill_jobs(self) -> None:
        """SIGKILL every job process on every host (sshd stays), and undo link faults."""
        for h in self.hosts:
            h.kill_all()
            _ip("link", "set", h.veth, "up", check=False)
            h.netem(None)  # removes any root qdisc (netem or htb)

    # --- teardown -------------------------------------------------------------------------------------
    def stop(self) -> None:
        if not self.started:
            return
        self.started = False
        for h in self.hosts:
            if h.sshd is not None and h.sshd.poll() is None:
                _kill_pids([h.sshd.pid])
        for h in self.hosts:
            _remove_netns(h.netns)
            _ip("link", "del", h.veth, check=False)
        for h in self.hosts:
            if h.sshd is not None:
                try:
                    h.sshd.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        _ip("link", "del", self.bridge, check=False)
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass


if __name__ == "__main__":  # smoke check: python tests/cluster/netns.py
    with Cluster(2) as demo:
        for h in demo.hosts:
            print(h, h.run([str(demo.bin / "ssh"), demo.hosts[-1].name, "hostname -I; hostname"]).stdout.split())
