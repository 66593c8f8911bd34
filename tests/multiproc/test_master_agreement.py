"""Real launchers: ranks detect their World and agree on one master address and port."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from procs import BIN, REPO, check, free_port, loopback_env, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

SHOW_WORLD = """
import dataclasses, json, pathlib, sys
from polytrain.environments import detect_world, ensure_master
world = detect_world()
if sys.argv[2:] == ["--agree"]:
    world = ensure_master(world)
pathlib.Path(sys.argv[1], f"world-{world.rank}.json").write_text(json.dumps(dataclasses.asdict(world)))
"""  # one file per rank: two ranks printing to one pipe can interleave their lines (seen in CI)


def worlds(tmp_path: Path, launcher_cmd: list[str], *args: str, env: dict[str, str]) -> list[dict]:
    script = tmp_path / "show_world.py"
    script.write_text(SHOW_WORLD)
    out = tmp_path / "worlds"
    out.mkdir()
    check(run([*launcher_cmd, str(BIN / "python"), str(script), str(out), *args], timeout=120, env=env))
    found = [json.loads(path.read_text()) for path in out.glob("world-*.json")]
    return sorted(found, key=lambda w: w["rank"])


def mpi_env(**extra: str) -> dict[str, str]:
    env = loopback_env(PYTHONPATH=str(REPO), **extra)
    if "MASTER_ADDR" not in extra:
        env.pop("MASTER_ADDR")  # a plain mpirun names no master: the ranks must agree on one
    return env


MPIRUN = [str(BIN / "mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "2"]
# what horovodrun 0.28.1 adds to Open MPI's mpirun in MPI mode (horovod/runner/mpi_run.py)
HOROVODRUN_MPI = ["--mca", "pml", "ob1", "--mca", "btl", "^openib", "-x", "NCCL_SOCKET_IFNAME=lo"]


@pytest.mark.parametrize(("extra", "launcher"), [([], "openmpi"), (HOROVODRUN_MPI, "horovodrun-mpi")],
                         ids=["mpirun", "horovodrun-mpi-flags"])
def test_mpirun_ranks_agree_on_master(tmp_path: Path, extra: list[str], launcher: str) -> None:
    found = worlds(tmp_path, [*MPIRUN, *extra], "--agree", env=mpi_env())
    assert [w["rank"] for w in found] == [0, 1]
    assert {w["launcher"] for w in found} == {launcher}
    assert {(w["size"], w["local_size"], w["num_nodes"], w["node_rank"]) for w in found} == {(2, 2, 1, 0)}
    assert [w["local_rank"] for w in found] == [0, 1]
    (addr, port), = {(w["master_addr"], w["master_port"]) for w in found}  # one value shared by both ranks
    assert addr == "127.0.0.1"
    assert 1024 <= port <= 65535
    with socket.socket() as sock:  # rank 0 chose a port nothing else holds
        sock.bind(("127.0.0.1", port))


def test_mpirun_with_exported_master_needs_no_agreement(tmp_path: Path) -> None:
    port = free_port()
    env = mpi_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    found = worlds(tmp_path, MPIRUN, "--agree", env=env)
    assert [(w["rank"], w["master_addr"], w["master_port"], w["launcher"]) for w in found] == [
        (0, "127.0.0.1", port, "openmpi"), (1, "127.0.0.1", port, "openmpi")]


def test_torchrun_workers_detect_their_world(tmp_path: Path) -> None:
    port = free_port()
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
           "--no-python"]
    found = worlds(tmp_path, cmd, env=loopback_env(PYTHONPATH=str(REPO)))
    assert [(w["rank"], w["local_rank"]) for w in found] == [(0, 0), (1, 1)]
    assert {(w["size"], w["local_size"], w["num_nodes"], w["launcher"], w["master_port"]) for w in found} == {
        (2, 2, 1, "torchrun", port)}
