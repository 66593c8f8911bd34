"""Where rank 0's listeners bind (`polytrain.comm.net.store_bind`, `board_address`): the address the ranks reach,
loopback on one host, never every interface unless no single address serves every rank."""

from __future__ import annotations

import pytest

from polytrain.comm import net as net


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Host names resolved from this table (as /etc/hosts would); addresses themselves as they are."""
    table: dict[str, list[str]] = {}
    real = net.addresses_of
    monkeypatch.setattr(net, "addresses_of", lambda host: table.get(host, []) if host.isalpha() else real(host))
    return table


def test_a_loopback_master_binds_itself() -> None:
    assert net.store_bind("127.0.0.1", True) == net.StoreBind("127.0.0.1", "single node: loopback only")
    assert net.store_bind("localhost", False).address == "localhost"


def test_a_host_name_on_loopback_binds_it_on_one_host_and_every_interface_across_hosts(names) -> None:
    """Debian's ``127.0.1.1 <hostname>``: the ranks of this host reach the store there, those of other hosts
    at this host's network address — one address cannot serve both."""
    names["debian"] = ["127.0.1.1"]
    assert net.store_bind("debian", True) == net.StoreBind("127.0.1.1", "single node: debian is loopback here")
    bind = net.store_bind("debian", False)
    assert bind.address is None
    assert bind.why == ("multi-node: debian is 127.0.1.1 (loopback) on this host, the other hosts reach it at "
                        "another address; export MASTER_ADDR as an address every host reaches")


def test_a_name_of_this_hosts_network_address_binds_that_address(names) -> None:
    address = net.board_address(None)  # this host's address on its default route
    if address is None:
        pytest.skip("this host has no address other than loopback")
    names["node"] = [address]
    assert net.store_bind("node", False) == net.StoreBind(address, "multi-node: the address node names here")
    assert net.store_bind(address, False).address == address
    assert net.board_address("node") == address


def test_a_master_that_is_not_this_host_binds_nothing_of_its_own(names) -> None:
    names["elsewhere"] = ["192.0.2.254"]  # TEST-NET: an address of no host here
    assert net.store_bind("elsewhere", False) == net.StoreBind(None, "multi-node: elsewhere names no address of "
                                                                     "this host")
    assert net.board_address("elsewhere") != "192.0.2.254"


def test_the_start_up_line_says_when_torchruns_agent_hosts_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """polytrain does not create torchrun's agent store, which torchrun binds to every interface: the line
    must not claim loopback for it."""
    pytest.importorskip("torch")
    from polytrain.adapters.torch.backend import listen_address
    from polytrain.world import World

    world = World(rank=0, size=2, local_rank=0, local_size=2, master_addr="127.0.0.1", master_port=29555,
                  launcher="torchrun")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert listen_address(world) == "127.0.0.1:29555 (single node: loopback only)"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert listen_address(world) == ("127.0.0.1:29555, torchrun's agent store (torchrun binds it to every "
                                     "interface; polytrain does not control it)")


def test_a_store_port_can_be_bound_again_right_after_its_store_closed_but_not_while_it_listens() -> None:
    """The store closed first, so its side of the connection waits in TIME_WAIT for a minute: the next job
    on the same MASTER_PORT must still be able to listen there (CI: the next multi-host test could not).
    A port another socket listens on stays refused, so a real clash is still reported."""
    import socket

    first = net.listening_socket("127.0.0.1", 0, 4)
    port = first.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    served, _ = first.accept()
    served.close()  # the server side closes first: its end of the connection is now in TIME_WAIT
    first.close()
    client.close()
    with pytest.raises(OSError):
        net.listening_socket("127.0.0.1", (taken := net.listening_socket("127.0.0.1", 0, 4)).getsockname()[1], 4)
    again = net.listening_socket("127.0.0.1", port, 4)
    assert again.getsockname()[1] == port
    for sock in (again, taken):
        sock.close()
