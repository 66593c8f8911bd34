"""The multi-container check of docker/image_check.py: two containers of the image on one podman network act as
two hosts (each its own address, no host network, the network internal: no route out), run as docker/README.md's
"several nodes" section says (the entry point's `sshd`, the cluster's keys mounted at /run/polytrain-ssh). From the
first, `polytrain launch` starts a 2x2 job over ssh under torchrun and under mpirun; both must train exactly the
model a 4-process job in one container trains (same weights digest). Then a container is killed mid-job: the
launch must end non-zero, naming the lost host and its ranks, and nothing may be left running on the other."""

from __future__ import annotations

import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from image_check import CheckFailed, Podman, Runner

HOSTS = ("node1", "node2")


class Cluster:
    """The network, the keys and the two `sshd` containers; `close` removes them all."""

    def __init__(self, podman: Podman, image: str, runs: Path) -> None:
        self.podman, self.image, self.runs = podman, image, runs
        self.tag = f"{os.getpid()}-{random.randrange(1 << 16):04x}"
        self.network = f"polytrain-check-{self.tag}"
        self.keys = Path(tempfile.mkdtemp(prefix="polytrain-image-keys-"))
        self.names = {host: f"polytrain-{host}-{self.tag}" for host in HOSTS}

    def open(self) -> Cluster:
        for name in ("id_ed25519", "ssh_host_ed25519_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "polytrain-image-check",
                            "-f", str(self.keys / name)], check=True, timeout=60)
        subprocess.run(["chown", "-R", "1000:1000", str(self.keys)], check=True)
        self.keys.chmod(0o700)
        subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}.0/24"
        self.podman("network", "create", "--internal", "--subnet", subnet, "--label", self.podman.label,
                    self.network)
        for host, name in self.names.items():
            self.podman("run", "-d", "--name", name, "--hostname", host, "--network-alias", host,
                        "--network", self.network, *self.podman.container_options(),
                        "-v", f"{self.keys}:/run/polytrain-ssh:ro", "-v", f"{self.runs}:/workspace/runs",
                        self.image, "sshd")
        deadline = time.monotonic() + 60
        while self.exec("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", HOSTS[1], "true",
                        check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{HOSTS[0]} cannot ssh to {HOSTS[1]} within 60 s")
            time.sleep(0.5)
        return self

    def exec(self, *argv: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return self.podman("exec", self.names[HOSTS[0]], *argv, check=check, timeout=timeout)

    def launch_argv(self, launcher: str, output: str, *train_args: str) -> list[str]:
        """`podman exec` on the first host of `polytrain launch` with 2 ranks on each host; ``train_args`` go to
        `polytrain train`."""
        return ["exec", self.names[HOSTS[0]], "polytrain", "launch", "--launcher", launcher,
                "-H", ",".join(f"{h}:2" for h in HOSTS), "-np", "4", "examples/digits.yaml",
                "--set", f"output=runs/{output}", *train_args]

    def close(self) -> None:
        self.podman("rm", "-f", "-t", "0", *self.names.values(), check=False)
        self.podman("network", "rm", "-f", self.network, check=False)
        subprocess.run(["rm", "-rf", str(self.keys)], check=False)


def check_multi_host(run: Runner) -> str:
    run("launch", "--launcher", "torchrun", "-np", "4", "examples/digits.yaml", "--quiet",
        "--set", "output=runs/one-host")
    reference = run.model("one-host")
    cluster = Cluster(run.podman, run.image, run.runs).open()
    try:
        for launcher in ("torchrun", "mpirun"):
            cluster.podman(*cluster.launch_argv(launcher, f"two-hosts-{launcher}", "--quiet"))
            model = run.model(f"two-hosts-{launcher}")
            if (model["world_size"], model["rank_state_digests"][0]) != (4, reference["rank_state_digests"][0]):
                raise CheckFailed(f"{launcher} on 2 containers x 2: world {model['world_size']}, val accuracy "
                                  f"{model['val_accuracy']} - not the model of 4 processes in one container "
                                  f"({reference['val_accuracy']})")
        lost = _kill_mid_job(cluster)
    finally:
        cluster.close()
    return (f"torchrun and mpirun 2x2 over ssh between containers = 4 processes in one "
            f"(val accuracy {reference['val_accuracy']:.4f}, same weights); killed container: {lost}")


def _kill_mid_job(cluster: Cluster) -> str:
    """Start a long job across both, kill the second container once the job has logged a step, and read what
    the launch says."""
    metrics = cluster.runs / "killed" / "metrics.jsonl"
    job = cluster.podman.popen(*cluster.launch_argv("torchrun", "killed", "--set", "loop.epochs=500"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while '"step"' not in (metrics.read_text() if metrics.exists() else ""):
            if job.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed("the job to be cut never logged a step")
            time.sleep(0.2)
        cluster.podman("kill", cluster.names[HOSTS[1]])
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    said = [line for line in out.splitlines() if line.startswith("polytrain launch:")]
    named = f"ranks 2, 3 on host {HOSTS[1]} ended with the host"  # torchrun's node ranks follow -H's order
    if job.returncode == 0 or not any(named in line for line in said):
        raise CheckFailed(f"killing {HOSTS[1]}: exit {job.returncode}, the launch said {said or out[-600:]}")
    ended, deadline = time.monotonic(), time.monotonic() + 60
    while busy := _running(cluster):  # the launch has stopped the other host's torchrun: its guard winds down
        if time.monotonic() > deadline:
            raise CheckFailed(f"still running on {HOSTS[0]} 60 s after {HOSTS[1]} was killed: {busy}")
        time.sleep(0.5)
    return (f"exit {job.returncode}, {HOSTS[0]} clean {time.monotonic() - ended:.1f} s after the launch ended; "
            + " / ".join(repr(line) for line in said))


def _running(cluster: Cluster) -> list[str]:
    """The job's processes still on the first host (its sshd and `ps` itself aside)."""
    left = cluster.exec("ps", "-eo", "args", check=False).stdout.splitlines()[1:]
    return [p for p in left if "polytrain" in p and "sshd" not in p and not p.startswith("ps ")]
