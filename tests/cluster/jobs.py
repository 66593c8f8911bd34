"""Jobs on the cluster for tests and benches: start a command on a host, follow its output, wait with a
deadline, look at what it trained. No pytest import (benches use it too)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from netns import REPO, Cluster, Host

PY = [sys.executable, "-m", "polytrain.cli"]
SPEC = REPO / "examples" / "digits.yaml"
WORKER_MARK = "polytrain.cli train"


class Job:
    """A command running on ``host`` (from the repository root), its stdout and stderr collected as they come."""

    def __init__(self, cluster: Cluster, host: Host, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.cluster, self.host, self.cmd = cluster, host, cmd
        self.started = time.monotonic()
        self.proc = host.popen(cmd, env=env or cluster.env(), cwd=REPO, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()
        self.ended: float | None = None

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for raw in iter(stream.readline, b""):
            lines.append(raw.decode(errors="replace"))

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def text(self) -> str:
        return f"$ {' '.join(self.cmd)}\nstdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-6000:]}"

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        """Wait until a line of stdout or stderr matches ``pattern`` (AssertionError after ``timeout``)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in [*self.out, *self.err]:
                if found := regex.search(line):
                    return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}\n{self.text()}")

    def wait(self, timeout: float = 240) -> int:
        """The exit code; after ``timeout`` the job is killed and AssertionError raised."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cluster.kill_jobs()
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"timed out after {timeout}s\n{self.text()}") from None
        self.ended = time.monotonic()
        for reader in self.readers:
            reader.join(timeout=10)
        return code

    def check(self, timeout: float = 240) -> Job:
        code = self.wait(timeout)
        assert code == 0, f"exit {code}\n{self.text()}"
        return self

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started


def launch(cluster: Cluster, *args: str, host: Host | None = None, env: dict[str, str] | None = None) -> Job:
    """``polytrain ARGS`` started on ``host`` (default: the first)."""
    return Job(cluster, host or cluster.hosts[0], [*PY, *args], env)


def sets(*values: str) -> list[str]:
    return [a for value in values for a in ("--set", value)]


LAUNCHER_MARKS = ("torchrun", "ssh_guard", "deepspeed", "mpirun", "prted", "horovodrun", "srun", "mpiexec", "hydra")


def worker_pids(host: Host) -> list[int]:
    """The polytrain workers on ``host`` (not the launchers whose command lines carry the worker's)."""
    return [pid for pid, cmd in host.commands().items()
            if WORKER_MARK in cmd and not any(mark in cmd.split(WORKER_MARK)[0] for mark in LAUNCHER_MARKS)]


def wait_no_processes(cluster: Cluster, timeout: float = 60) -> dict[str, dict[int, str]]:
    """Poll until no job process is left on any host; returns what is still there at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := cluster.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def trained(out: Path, world: int, backend: str | None = None, accuracy: float = 0.9) -> dict:
    """The manifest of a finished job, after checking its world size, identical replicas and accuracy."""
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["world_size"] == world, manifest["world_size"]
    if backend is not None:
        assert manifest["backend"] == backend, manifest["backend"]
    digests = manifest["rank_state_digests"]
    assert len(digests) == world and len(set(digests)) == 1, f"ranks disagree on the weights: {digests}"
    assert manifest["val_accuracy"] >= accuracy, manifest["val_accuracy"]
    return manifest
