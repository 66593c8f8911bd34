"""Multi-host jobs over real SSH between network namespaces: `polytrain launch` with torchrun (the ssh
fan-out), deepspeed (fan-out of ``deepspeed --no_ssh``) and mpirun (Open MPI's own ssh launch), on 2 hosts.

Each job trains the digits MLP; every rank must end with the same weights (the manifest's per-rank
digests) and the accuracy reached, and nothing may be left running on any host."""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest
from jobs import SPEC, launch, sets, trained, wait_no_processes, worker_pids

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

EPOCHS = "loop.epochs=8"
LOOPBACK = re.compile(r"\b127\.\d+\.\d+\.\d+")


def listening_while_running(cluster, job) -> dict[str, set[tuple[str, int]]]:
    """Until ``job`` ends: for each host, the listening sockets its polytrain workers held."""
    seen: dict[str, set[tuple[str, int]]] = {h.name: set() for h in cluster.hosts}
    while job.proc.poll() is None:
        for host in cluster.hosts:
            pids = worker_pids(host)
            if pids:
                seen[host.name] |= set(host.listening(pids))
        time.sleep(0.2)
    return seen


def test_torchrun_dry_run_prints_every_host(cluster) -> None:
    job = launch(cluster, "launch", "--launcher", "torchrun", "-H", "h1:2,h2:2", "--dry-run", str(SPEC)).check(60)
    lines = [line for line in job.stdout.splitlines() if line.startswith("ssh ")]
    assert len(lines) == 2, job.text()
    for i, line in enumerate(lines):
        assert f" h{i + 1} " in line and f"--node_rank={i}" in line and "--master_addr=h1" in line, line
    assert not cluster.leftovers()


def test_torchrun_fans_out_over_ssh_to_two_hosts(cluster, tmp_path: Path) -> None:
    """4 ranks on 2 hosts; the ranks listen on their host's bridge address, never on loopback."""
    out = tmp_path / "out"
    job = launch(cluster, "launch", "--launcher", "torchrun", "-H", "h1:2,h2:2", "--master-port", "29401",
                 str(SPEC), *sets(f"output={out}", EPOCHS))
    seen = listening_while_running(cluster, job)
    job.check()
    trained(out, 4, "ddp")
    assert "launcher: torchrun" in job.stderr
    rendezvous = [line for line in job.stderr.splitlines() if "rendezvous" in line]
    assert rendezvous and not any(LOOPBACK.search(line) for line in rendezvous), rendezvous
    for host in cluster.hosts:
        assert seen[host.name], f"no listening socket of a worker seen on {host.name}"
        assert {addr for addr, _ in seen[host.name]} == {host.addr}, (host, seen)
    assert wait_no_processes(cluster) == {}


def test_single_host_job_in_a_namespace_listens_on_loopback_only(cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = launch(cluster, "launch", "--launcher", "torchrun", "-np", "2", str(SPEC),
                 *sets(f"output={out}", "loop.epochs=2"), host=cluster.hosts[1])
    seen = listening_while_running(cluster, job)
    job.check()
    trained(out, 2, "ddp", accuracy=0.0)
    assert seen["h2"] and {addr for addr, _ in seen["h2"]} == {"127.0.0.1"}, seen
    assert not seen["h1"]


def test_deepspeed_fans_out_over_ssh_to_two_hosts(cluster, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    dry = launch(cluster, "launch", "--launcher", "deepspeed", "-H", "h1:1,h2:1", "--dry-run", str(SPEC)).check(60)
    assert [line.split()[3] for line in dry.stdout.splitlines() if line.startswith("ssh ")] == ["h1", "h2"]
    job = launch(cluster, "launch", "--launcher", "deepspeed", "-H", "h1:1,h2:1", "--master-port", "29402",
                 str(SPEC), *sets(f"output={out}", EPOCHS)).check()
    trained(out, 2)
    assert wait_no_processes(cluster) == {}, job.text()


MPI_JOBS = {  # name: (launcher flags, framework, backend set in the spec, backend in the manifest)
    "mpirun-torch-ddp": (["--launcher", "mpirun"], "torch", "ddp", "ddp"),
    "mpirun-torch-mpi": (["--launcher", "mpirun"], "torch", "mpi", "mpi"),
    "mpirun-torch-horovod": (["--launcher", "mpirun"], "torch", "horovod", "horovod"),
    # polytrain's own hvd (its MPI transport under mpirun) rather than the real Horovod installed here
    "mpirun-torch-horovod-shim": (["--launcher", "mpirun", "-x", "POLYTRAIN_HOROVOD_IMPL=shim"], "torch", "horovod",
                                  "horovod"),
    "mpirun-tf-mpi": (["--launcher", "mpirun"], "tensorflow", "mpi", "mpi"),
    "mpirun-tf-multiworker": (["--launcher", "mpirun"], "tensorflow", "tf-multiworker", "tf-multiworker"),
    "horovodrun-gloo-horovod": (["--launcher", "horovodrun", "--gloo"], "torch", "horovod", "horovod"),
    "horovodrun-mpi-horovod": (["--launcher", "horovodrun", "--mpi"], "torch", "horovod", "horovod"),
    "horovodrun-gloo-auto": (["--launcher", "horovodrun", "--gloo"], "torch", "auto", "ddp"),
}


def meets_at_a_rendezvous(flags: list[str], backend: str) -> bool:
    """Whether the job's backend listens for its peers (and prints where): torch's process group (ddp, and
    polytrain's hvd, which joins one) and TensorFlow's gRPC cluster; not backend mpi, nor real Horovod."""
    if backend == "horovod":
        shim = any("POLYTRAIN_HOROVOD_IMPL" in flag for flag in flags)  # the jobs set it only to ask for the shim
        return shim or importlib.util.find_spec("horovod") is None
    return backend in ("ddp", "tf-multiworker")


@pytest.mark.parametrize("name", list(MPI_JOBS))
def test_mpi_family_launchers_over_ssh_to_two_hosts(cluster, tmp_path: Path, name: str) -> None:
    """Open MPI's mpirun and horovodrun (gloo and MPI mode) start one rank on each host over the cluster's
    ssh; the backend in the manifest is the one asked for, the replicas are identical."""
    flags, framework, backend, expected = MPI_JOBS[name]
    pytest.importorskip(framework)
    if "horovodrun" in flags:
        pytest.importorskip("horovod")
    out = tmp_path / "out"
    job = launch(cluster, "launch", *flags, "-H", "h1:1,h2:1", str(SPEC),
                 *sets(f"output={out}", "loop.epochs=4", f"framework={framework}", f"backend={backend}")).check()
    trained(out, 2, expected, accuracy=0.85)
    rendezvous = [line for line in job.stderr.splitlines() if "rendezvous listens on" in line]
    if meets_at_a_rendezvous(flags, expected):  # the line must be there, and name no loopback address
        assert rendezvous and not any(LOOPBACK.search(line) for line in rendezvous), job.text()
    else:  # the ranks meet over MPI or in Horovod's own runtime: polytrain listens on nothing, and says nothing
        assert rendezvous == [], rendezvous
    assert wait_no_processes(cluster) == {}, job.text()


def test_an_unreachable_host_fails_the_launch_in_one_line(cluster, tmp_path: Path) -> None:
    """ssh cannot resolve h9: exit code 255 (ssh's), one line naming the host, the started host stopped."""
    job = launch(cluster, "launch", "--launcher", "torchrun", "-H", "h1:1,h9:1", "--master-port", "29403",
                 str(SPEC), *sets(f"output={tmp_path / 'out'}"))
    assert job.wait(120) == 255, job.text()
    ours = [line for line in job.err if line.startswith("polytrain launch:")]
    assert ours == ["polytrain launch: host h9 (node 1 of 2): ssh could not reach it or lost the connection; "
                    "stopped the other hosts\n"], job.text()
    assert wait_no_processes(cluster) == {}, job.text()
