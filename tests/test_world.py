"""World basics, free_port, and the cases of ensure_master that need no MPI."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from polytrain.comm.net import ephemeral_range, free_port, port_to_hold, route_address
from polytrain.environments import detect_world, ensure_master
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World


def test_world_defaults_are_one_process() -> None:
    world = World()
    assert (world.rank, world.size, world.launcher) == (0, 1, "single")
    assert world.is_main and not world.distributed and not world.master_known
    assert World(rank=1, size=2, master_port=29500).distributed
    assert not World(rank=1, size=2).is_main


def test_free_port_is_bindable_and_in_range() -> None:
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # nothing holds it
    assert 1024 <= free_port("0.0.0.0") <= 65535


def test_a_port_to_hold_is_below_the_ephemeral_range_free_and_not_taken(tmp_path) -> None:
    low, high = ephemeral_range()
    assert 1024 < low < high
    ports = []
    for _ in range(20):
        ports.append(port_to_hold(taken=set(ports)))
    assert len(set(ports)) == 20 and all(max(1024, low - 12000) <= port < low for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # nothing holds it
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_range(str(tmp_path / "range")) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_a_block_of_ports_to_hold_is_free_in_a_row_and_misses_the_taken(monkeypatch) -> None:
    """tf-multiworker's workers listen on master_port + 1 + local rank: the launcher holds the whole block."""
    low, _ = ephemeral_range()
    monkeypatch.setattr("polytrain.comm.net.random.sample", lambda population, k: [low - 5, low - 9])
    monkeypatch.setattr("polytrain.comm.net._bindable", lambda host, port: port != low - 3)  # low - 3 is bound
    assert port_to_hold(count=4) == low - 9  # low-5..low-2 holds the bound port
    assert port_to_hold(count=2) == low - 5
    monkeypatch.setattr("polytrain.comm.net.free_port", lambda host: 1)
    assert port_to_hold(count=4, taken={low - 7}) == 1  # a taken port inside the block rules it out: none left


def test_free_port_skips_a_taken_port() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(20))


def test_ensure_master_leaves_single_and_known_worlds_alone() -> None:
    single = World()
    assert ensure_master(single) is single
    known = World(rank=1, size=2, local_rank=1, local_size=2, master_addr="127.0.0.1", master_port=29500,
                  launcher="openmpi")
    assert ensure_master(known) is known
    torchrun = detect_world({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"})
    assert ensure_master(torchrun) is torchrun


@pytest.mark.parametrize(("env", "missing"), [
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT not set"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2",
      "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1", "HOROVOD_CONTROLLER": "gloo"},
     "MASTER_ADDR and MASTER_PORT not set"),
])
def test_ensure_master_without_mpi_asks_for_master_variables(env: dict[str, str], missing: str) -> None:
    with pytest.raises(EnvironmentDetectionError, match=f"^{missing} and launcher") as info:
        ensure_master(detect_world(env))
    assert "export MASTER_ADDR and MASTER_PORT" in str(info.value)


def test_import_polytrain_imports_no_framework_nor_mpi() -> None:
    code = ("import sys, polytrain, polytrain.environments, polytrain.world;"
            "w = polytrain.detect_world({'OMPI_COMM_WORLD_RANK': '0', 'OMPI_COMM_WORLD_SIZE': '2',"
            " 'OMPI_COMM_WORLD_LOCAL_RANK': '0', 'OMPI_COMM_WORLD_LOCAL_SIZE': '2'});"
            "assert w.launcher == 'openmpi' and w.master_port is None;"
            "print(sorted(m for m in ('torch', 'tensorflow', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_route_address_is_one_other_hosts_can_reach():
    """Not ``gethostbyname(gethostname())``, which is 127.0.1.1 (Debian) or 127.0.0.1 (here) on many hosts."""
    import ipaddress

    assert route_address("127.0.0.1") == "127.0.0.1"
    address = route_address()
    with socket.socket() as sock:
        sock.bind((address, 0))  # an address of this host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:  # no route off this host at all: the host name's address is all there is
            return
    assert not ipaddress.ip_address(address).is_loopback
