"""Debian's MPICH (Hydra's ``mpiexec``) across the cluster's two hosts, beside the venv's Open MPI (mpich.py).

- ``mpiexec -n 4 -hosts h1,h2``: every rank is detected as MPICH from the real PMI_*/MPI_LOCAL* variables,
  and mpi4py (the venv's wheel on its MPICH ABI) joins the same 4-rank world.
- With MASTER_ADDR/PORT exported, round-robin ranks still learn their real node (host names gathered).
- The same plain mpiexec (no master named) trains ddp over gloo: the ranks agree on a master over MPI, the
  bridge address of h1, and end with identical replicas.
- Under MPICH, an mpi4py on Open MPI is refused with one line per rank, not a hang.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from jobs import REPO, SPEC, sets, trained, wait_no_processes
from mpich import mpich_env, mpich_unavailable, mpiexec
from netns import Cluster

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

PROBE = str(Path(__file__).resolve().parent / "world_probe.py")


@pytest.fixture(autouse=True)
def _needs_mpich() -> None:
    why = mpich_unavailable()
    if why:
        pytest.skip(f"no MPICH here: {why}")


def test_hydra_ranks_are_detected_as_mpich(cluster: Cluster, tmp_path: Path) -> None:
    folder = tmp_path / "probe"
    folder.mkdir()
    done = cluster.hosts[0].run(mpiexec(cluster, 4, "h1,h2", [sys.executable, PROBE, "--mpi", str(folder)]),
                                env=mpich_env(cluster, tmp_path), cwd=REPO, check=False, timeout=120)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    seen = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    assert sorted(p["world"]["rank"] for p in seen) == [0, 1, 2, 3]
    hosts = {p["world"]["rank"]: p["host"] for p in seen}
    assert sorted(hosts.values()) == ["h1", "h1", "h2", "h2"], hosts
    for p in seen:
        world, env, mpi, agreed = p["world"], p["env"], p["mpi"], p["agreed"]
        assert p["environment"] == "MpichEnvironment" and world["launcher"] == "mpich", p
        assert env["PMI_RANK"] == str(world["rank"]) and env["PMI_SIZE"] == "4", env
        assert (world["size"], world["local_size"], world["num_nodes"]) == (4, 2, 2), world
        assert world["local_rank"] == int(env["MPI_LOCALRANKID"]), p
        assert world["master_addr"] is None and world["master_port"] is None, world  # hydra names no master
        # mpi4py on MPICH's ABI: the same world as the PMI variables
        assert mpi["library"].startswith("MPICH") and (mpi["rank"], mpi["size"], mpi["sum"]) == (world["rank"], 4, 4)
        # after the agreement over MPI: the exact node of each rank, and h1's bridge address as master
        assert agreed["node_rank"] == ["h1", "h2"].index(p["host"]) and agreed["num_nodes"] == 2, p
        assert agreed["master_addr"] == cluster.host(hosts[0]).addr, agreed


def test_round_robin_ranks_get_their_real_node_with_the_master_exported(cluster: Cluster, tmp_path: Path) -> None:
    """Hydra places ``-hosts h1,h2`` round-robin; the environment's in-order guess of node_rank is wrong for
    ranks 1 and 2, and with MASTER_ADDR/PORT exported there is no master to agree on — the host names are
    gathered anyway, so every rank learns its real node."""
    folder = tmp_path / "probe"
    folder.mkdir()
    env = mpich_env(cluster, tmp_path, MASTER_ADDR=cluster.hosts[0].addr, MASTER_PORT="29555")
    done = cluster.hosts[0].run(mpiexec(cluster, 4, "h1,h2", [sys.executable, PROBE, "--mpi", str(folder)]),
                                env=env, cwd=REPO, check=False, timeout=120)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    seen = sorted((json.loads(p.read_text()) for p in folder.glob("*.json")), key=lambda p: p["world"]["rank"])
    assert [p["host"] for p in seen] == ["h1", "h2", "h1", "h2"]  # round-robin
    assert [p["world"]["node_rank"] for p in seen] == [0, 0, 1, 1]  # the guess: ranks fill nodes in order
    assert [p["agreed"]["node_rank"] for p in seen] == [0, 1, 0, 1]
    assert {(p["agreed"]["master_addr"], p["agreed"]["master_port"], p["agreed"]["num_nodes"]) for p in seen} == \
        {(cluster.hosts[0].addr, 29555, 2)}  # the exported master is kept


def test_hydra_trains_ddp_across_hosts(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    program = [sys.executable, "-m", "polytrain.cli", "train", str(SPEC),
               *sets(f"output={out}", "backend=ddp", "loop.max_steps=60")]
    done = cluster.hosts[0].run(mpiexec(cluster, 4, "h1,h2", program), env=mpich_env(cluster, tmp_path),
                                cwd=REPO, check=False, timeout=240)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "torch/ddp on 4 process(es) (launcher: mpich)" in text, text
    # the master is h1's cluster address (never 127.x), and rank 0's store listens there, not everywhere
    found = re.search(r"rendezvous listens on ([\d.]+):\d+ \(multi-node: the address ([\d.]+) names here\)", text)
    assert found is not None and found.groups() == (cluster.hosts[0].addr,) * 2, text
    trained(out, 4, "ddp")
    assert wait_no_processes(cluster, 30) == {}, "processes left on the hosts"


def test_mpi4py_of_another_mpi_is_refused_in_one_line(cluster: Cluster, tmp_path: Path) -> None:
    """Without the MPICH ABI settings the venv's mpi4py loads Open MPI, a world of 1: each rank says so."""
    program = [sys.executable, "-m", "polytrain.cli", "train", str(SPEC), *sets(f"output={tmp_path / 'run'}")]
    # btl self,tcp: the Open MPI singletons leave no shared-memory segment in /dev/shm when they exit on the error
    done = cluster.hosts[0].run(mpiexec(cluster, 2, "h1,h2", program), env=cluster.env(OMPI_MCA_btl="self,tcp"),
                                cwd=REPO, check=False, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("polytrain: error:")]
    assert sorted(errors) == [f"polytrain: error: MPI says rank 0 of 1 but the mpich variables say rank {r} of 2; "
                              "launch with that launcher's own mpirun" for r in (0, 1)], done.stderr
    assert "Traceback" not in done.stderr
