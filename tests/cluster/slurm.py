"""A real Slurm (Debian ``slurm-wlm``) with ``munge`` on a `netns.Cluster`: slurmctld on the first host, a
slurmd on every host, a generated ``slurm.conf``; ``sbatch``, ``srun``, ``squeue`` work with `SlurmCluster.env`.

Everything lives under ``workdir`` (config, munge key and socket, state and spool directories, pid and log
files); nothing under /etc is read or written (``SLURM_CONF`` names the config for every command).

- munge: ONE ``munged`` in the root namespace with a per-run key. Its socket is a path in the shared
  filesystem, so the daemons and clients in every namespace reach it (a real cluster runs one munged per
  host with the same key; here every host would share that one key file and socket directory anyway).
- ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, no accounting, no cgroups: the hosts are
  network namespaces only, and the daemons run as root (``SlurmUser=root``).
- ``SlurmdParameters=config_overrides``: the nodes declare ``CPUs`` beyond this machine's cores, so two
  tasks per node fit on a 2-core machine.

Reusable outside pytest (benches): no pytest import here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from netns import Cluster

BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "srun", "sbatch", "squeue", "sinfo", "scontrol")
CPUS_PER_NODE = 4


def slurm_unavailable() -> str | None:
    """Why Slurm cannot run here (None when it can)."""
    for name in BINARIES:
        if shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin"])) is None:
            return f"{name} not found (apt-get install slurm-wlm munge)"
    return None


def _cgroup_version() -> str:
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1] == "/sys/fs/cgroup":
            return "v2" if fields[2] == "cgroup2" else "v1"
    return "v2"


def _which(name: str) -> str:
    return shutil.which(name, path=os.pathsep.join(["/usr/sbin", "/usr/bin", os.environ.get("PATH", "")])) or name


def _alive(proc: subprocess.Popen | None) -> bool:
    return proc is not None and proc.poll() is None


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class SlurmError(RuntimeError):
    """The daemons did not come up, or a job did not end in time; the message carries their logs."""


class SlurmCluster:
    """Slurm daemons on ``cluster``'s hosts. ``start()`` brings them up (and waits until every node is idle),
    ``ensure()`` restarts any that died, ``stop()`` ends them and removes ``workdir``."""

    def __init__(self, cluster: Cluster, workdir: Path | str, name: str = "ptc") -> None:
        self.cluster = cluster
        self.dir = Path(workdir).resolve()
        self.name = name
        self.conf = self.dir / "slurm.conf"
        self.munge_dir = self.dir / "munge"
        self.socket = self.munge_dir / "munge.socket"
        self.munged: subprocess.Popen | None = None
        self.slurmctld: subprocess.Popen | None = None
        self.slurmd: dict[str, subprocess.Popen] = {}
        self.starts = 0

    # --- files ----------------------------------------------------------------------------------------
    def write_config(self) -> None:
        d = self.dir
        for sub in ("state", "log", *(f"spool/{h.name}" for h in self.cluster.hosts)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        first = self.cluster.hosts[0]
        nodes = [f"NodeName={h.name} NodeAddr={h.addr} NodeHostname={h.name} CPUs={CPUS_PER_NODE} State=UNKNOWN"
                 for h in self.cluster.hosts]
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={first.name}({first.addr})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MailProg=/bin/true",
            "KillWait=30",  # Slurm's default: a preempted job's ranks stop and save between SIGTERM and SIGKILL
            "InactiveLimit=0",
            # a fresh range of job ids per start (slurmctld starts with its state cleared): jobs of a restarted
            # controller never reuse an earlier job's id, nor the MASTER_PORT an sbatch script derives from it
            f"FirstJobId={1 + 1000 * self.starts}",
            *nodes,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
        self.conf.write_text("\n".join(lines))
        # slurmd 22.05 loads a cgroup plugin whatever the proctrack/task plugins: name the mounted version
        # (autodetect fails where /sys/fs/cgroup is a tmpfs holding v1 controllers, as in gVisor)
        (self.dir / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/{_cgroup_version()}\nIgnoreSystemd=yes\n")

    def _write_munge_key(self) -> Path:
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o700)
        key = self.munge_dir / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        return key

    # --- daemons --------------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The cluster's environment (`Cluster.env`) plus ``SLURM_CONF``, for srun/sbatch/squeue/sinfo."""
        return self.cluster.env(SLURM_CONF=str(self.conf), **extra)

    def _log(self, name: str) -> Path:
        return self.dir / "log" / name

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Start munged, slurmctld and every slurmd (those not already running) and wait until the nodes are idle."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.write_config()
        key = self._write_munge_key()
        if not _alive(self.munged):
            self.socket.unlink(missing_ok=True)
            self.munged = subprocess.Popen(
                [_which("munged"), "-F", "-f", f"--socket={self.socket}", f"--key-file={key}",
                 f"--pid-file={self.munge_dir / 'munged.pid'}", f"--log-file={self._log('munged.log')}",
                 f"--seed-file={self.munge_dir / 'munged.seed'}"],
                stdout=subprocess.DEVNULL, stderr=open(self._log("munged.out"), "ab"), start_new_session=True)
        self._wait(lambda: self.socket.exists(), timeout, "munged's socket", "munged.out")
        env = self.env()
        first = self.cluster.hosts[0]
        if not _alive(self.slurmctld):
            self.slurmctld = first.popen([_which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)], env=env,
                                         stdout=subprocess.DEVNULL, stderr=open(self._log("slurmctld.out"), "ab"))
        for host in self.cluster.hosts:
            if not _alive(self.slurmd.get(host.name)):
                self.slurmd[host.name] = host.popen(
                    [_which("slurmd"), "-D", "-N", host.name, "-f", str(self.conf)], env=env,
                    stdout=subprocess.DEVNULL, stderr=open(self._log(f"slurmd.{host.name}.out"), "ab"))
        self.wait_idle(timeout)
        return self

    def alive(self) -> bool:
        return (_alive(self.munged) and _alive(self.slurmctld)
                and all(_alive(self.slurmd.get(h.name)) for h in self.cluster.hosts))

    def ensure(self, timeout: float = 60) -> SlurmCluster:
        """When any daemon died (e.g. killed by a test's clean-up): restart the Slurm daemons, all together."""
        if not self.alive():
            self.stop_slurm()
            self.start(timeout)
        return self

    def _wait(self, ready, timeout: float, what: str, log: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise SlurmError(f"{what} not ready within {timeout:.0f}s\n{self.logs(log)}")
            time.sleep(0.1)

    def logs(self, *names: str) -> str:
        names = names or tuple(sorted(p.name for p in (self.dir / "log").glob("*")))
        parts = []
        for name in names:
            path = self._log(name)
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def command(self, *args: str, timeout: float = 30, check: bool = True,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sinfo``, ``squeue``, ``scontrol``, ``sbatch`` ...) on the first host."""
        return self.cluster.hosts[0].run([_which(args[0]), *args[1:]], timeout=timeout, check=check,
                                         env=env or self.env())

    def node_states(self) -> dict[str, str]:
        done = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=15)
        if done.returncode:
            return {}
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float = 60) -> None:
        """Until ``sinfo`` shows every node idle."""
        names = {h.name for h in self.cluster.hosts}

        def ready() -> bool:
            for proc, log in ((self.slurmctld, "slurmctld.log"), *((self.slurmd.get(n), f"slurmd.{n}.log")
                                                                     for n in sorted(names))):
                if proc is not None and proc.poll() is not None:
                    raise SlurmError(f"a Slurm daemon exited ({proc.args})\n{self.logs(log)}")
            states = self.node_states()
            return set(states) == names and all(s == "idle" for s in states.values())

        self._wait(ready, timeout, "every node idle", "slurmctld.log")

    def jobs(self) -> list[str]:
        """The job ids ``squeue`` lists (pending, running, completing)."""
        done = self.command("squeue", "-h", "-o", "%i", timeout=15)
        return done.stdout.split()

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, StdOut ...)."""
        done = self.command("scontrol", "-o", "show", "job", job_id, timeout=15)
        fields = {}
        for item in done.stdout.split():
            key, sep, value = item.partition("=")
            if sep:
                fields[key] = value
        return fields

    def sbatch(self, script: Path, *args: str) -> str:
        """Submit ``script``; returns the job id."""
        done = self.command("sbatch", "--parsable", *args, str(script), timeout=30)
        return done.stdout.strip().split(";")[0]

    def wait_job(self, job_id: str, timeout: float = 240) -> dict[str, str]:
        """Until ``squeue`` no longer lists ``job_id``; returns its final ``scontrol show job`` fields."""
        deadline = time.monotonic() + timeout
        while job_id in self.jobs():
            if time.monotonic() > deadline:
                self.command("scancel", job_id, check=False)
                raise SlurmError(f"job {job_id} still queued after {timeout:.0f}s\n{self.logs()}")
            time.sleep(0.2)
        return self.job_state(job_id)

    def daemon_pids(self) -> set[int]:
        """slurmctld, its helper slurmscriptd (a child it forks at start), and the slurmds."""
        pids = {p.pid for p in (self.slurmctld, *self.slurmd.values()) if p is not None}
        if self.slurmctld is not None:
            for child in Path("/proc").glob("[0-9]*"):
                try:
                    fields = (child / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == self.slurmctld.pid:
                    pids.add(int(child.name))
        return pids

    def leftovers(self) -> dict[str, dict[int, str]]:
        """Processes on the hosts other than sshd and the Slurm daemons (slurmstepd included)."""
        keep = self.daemon_pids()
        found = {h: {pid: cmd for pid, cmd in cmds.items() if pid not in keep}
                 for h, cmds in self.cluster.leftovers().items()}
        return {h: cmds for h, cmds in found.items() if cmds}

    def wait_no_processes(self, timeout: float = 60) -> dict[str, dict[int, str]]:
        """Poll until `leftovers` is empty; returns what is still there at the deadline."""
        deadline = time.monotonic() + timeout
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    # --- teardown -------------------------------------------------------------------------------------
    def stop_slurm(self) -> None:
        for proc in self.slurmd.values():
            _stop(proc)
        _stop(self.slurmctld)
        self.slurmd.clear()
        self.slurmctld = None

    def stop(self, remove: bool = True) -> None:
        self.stop_slurm()
        _stop(self.munged)
        self.munged = None
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
