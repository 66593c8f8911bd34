"""Where a multi-node job listens, on two hosts over real ssh: rank 0's rendezvous store (ddp under mpirun,
MASTER_ADDR=h1) and the watchdog's store of the MPI backend listen on h1's cluster address, never on every
interface (0.0.0.0 / ::). Every listening socket of the workers on either host is on that host's address,
but Open MPI's own TCP transport in each rank (which binds every interface; here given ports of its own)."""

from __future__ import annotations

from pathlib import Path

import listen_probe
import pytest
from jobs import SPEC, launch, sets, trained, wait_no_processes

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

PORT = 29421
MPI_PORTS = range(40100, 40110)  # Open MPI's TCP BTL listeners (btl_tcp_port_min_v4/v6, port_range_v4/v6)
MPI_TCP = {"OMPI_MCA_btl_tcp_port_min_v4": str(MPI_PORTS.start), "OMPI_MCA_btl_tcp_port_range_v4": str(len(MPI_PORTS)),
           "OMPI_MCA_btl_tcp_port_min_v6": str(MPI_PORTS.start), "OMPI_MCA_btl_tcp_port_range_v6": str(len(MPI_PORTS))}


@pytest.mark.parametrize("backend", ["ddp", "mpi"])
def test_rank0s_stores_listen_on_the_cluster_address_only(cluster, tmp_path: Path, backend: str) -> None:
    out = tmp_path / "out"
    job = launch(cluster, "launch", "--launcher", "mpirun", "-H", "h1:1,h2:1", "--master-port", str(PORT),
                 *(f for name in MPI_TCP for f in ("-x", name)),
                 "-x", "PYTHONPATH", str(SPEC),
                 *sets(f"output={out}", "loop.epochs=2", f"backend={backend}", 'callbacks=["listen_probe:Listening"]'),
                 env=cluster.env(PYTHONPATH=str(Path(listen_probe.__file__).parent), **MPI_TCP)).check()
    trained(out, 2, backend, accuracy=0.0)
    h1 = cluster.hosts[0]
    hosts = cluster.hosts[:2]  # -H h1:1,h2:1: rank 0 on h1, rank 1 on h2
    seen = {host.name: listen_probe.read(out, rank) for rank, host in enumerate(hosts)}
    ours = {name: {(addr, port) for addr, port in sockets if port not in MPI_PORTS} for name, sockets in seen.items()}
    assert ours["h1"], f"no listening socket of rank 0 seen\n{job.text()}"  # its store(s)
    for host in hosts:
        assert {addr for addr, _ in ours[host.name]} <= {host.addr}, (host.name, seen)
    if backend == "ddp":  # the process group's store, at MASTER_ADDR=h1 and the port asked for
        assert (h1.addr, PORT) in seen["h1"], seen
        assert f"rendezvous listens on {h1.addr}:{PORT} (multi-node: the address h1 names here)" in job.stderr
    assert wait_no_processes(cluster) == {}, job.text()
