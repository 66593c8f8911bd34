"""A single-node job listens on loopback only: the rendezvous store rank 0 hosts and gloo's sockets.

Two ranks started with torchrun-style variables and MASTER_ADDR=127.0.0.1, no GLOO_SOCKET_IFNAME
(as a user's shell would have it). While they train, every TCP socket either process listens on
(read from /proc) must be bound to 127.0.0.1; rank 0 logs where it listens. The same for a
Horovod script on ``polytrain.horovod.torch`` (without Horovod: the shim's own rendezvous).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from procs import REPO, free_port, loopback_env, read_metrics

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(200)]


def listening(pids: set[int]) -> set[str]:
    """``address:port`` of every listening TCP socket owned by ``pids``."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            if width == 8:
                host = ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                host = "::" if set(address) == {"0"} else address
            found.add(f"{host}:{int(port, 16)}")
    return found


def watch(commands: list[list[str]], env: dict[str, str]) -> tuple[list[int], list[tuple[str, str]], set[str]]:
    """Start one command per rank (ranks 0, 1); every address any of them listens on until they end."""
    procs = []
    try:
        for rank, cmd in enumerate(commands):
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=REPO,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        seen: set[str] = set()
        deadline = time.monotonic() + 150
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            seen |= listening({p.pid for p in procs})
            time.sleep(0.05)
        outputs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return [p.returncode for p in procs], outputs, seen


def single_node_env(port: int) -> dict[str, str]:
    env = loopback_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(port),
                       POLYTRAIN_TEST_TOKEN=uuid.uuid4().hex)
    env.pop("GLOO_SOCKET_IFNAME")
    return env


HVD_SCRIPT = """\
import time
import torch
import polytrain.horovod.torch as hvd

hvd.init()
rank, total = hvd.rank(), torch.zeros(1)
deadline = time.monotonic() + 3
done = torch.zeros(1)
while not done.item():  # collectives for a few seconds: long enough to see every socket
    total += hvd.allreduce(torch.ones(1), op=hvd.Sum)
    # stop together (each rank's own clock alone would leave one rank in an allreduce the other skips)
    done = hvd.allreduce(torch.tensor([float(time.monotonic() > deadline)]), op=hvd.Max)
hvd.shutdown()
print(f"rank {rank} sum ok {int(total.item()) % 2 == 0}")
"""


def test_a_horovod_script_listens_on_loopback_only(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    port = free_port()
    script = tmp_path / "hvd_script.py"
    script.write_text(HVD_SCRIPT)
    env = single_node_env(port)
    env["PYTHONPATH"] = str(REPO)
    codes, outputs, seen = watch([[sys.executable, str(script)]] * 2, env)
    assert codes == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert all("sum ok True" in out for out, _ in outputs), outputs
    assert f"127.0.0.1:{port}" in seen  # rank 0's store was seen listening
    assert all(address.startswith("127.0.0.1:") for address in seen), seen


def test_single_node_job_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    commands = [[sys.executable, "-m", "polytrain.cli", "train", "--set", "loop.epochs=3",
                 "--set", f"output={tmp_path / str(rank)}"] for rank in (0, 1)]
    codes, outputs, seen = watch(commands, single_node_env(port))
    assert codes == [0, 0], outputs[0][1][-2000:]
    assert f"127.0.0.1:{port}" in seen  # the store was seen listening
    assert all(address.startswith("127.0.0.1:") for address in seen), seen
    assert f"rendezvous listens on 127.0.0.1:{port} (single node: loopback only)" in outputs[0][1]
    assert {"event": "rendezvous", "listen": f"127.0.0.1:{port} (single node: loopback only)"}.items() <= \
        read_metrics(tmp_path / "0", "rendezvous")[0].items()


def test_a_master_named_by_host_name_on_one_host_binds_what_the_name_resolves_to(tmp_path: Path) -> None:
    """MASTER_ADDR = this host's name (Debian resolves it to 127.0.1.1, others to their address): rank 0's
    store listens where the name resolves, as every rank resolves it alike, not on every interface."""
    from polytrain.comm.net import addresses_of

    port = free_port()
    name = socket.gethostname()
    address = addresses_of(name)[0]
    commands = [[sys.executable, "-m", "polytrain.cli", "train", "--set", "loop.epochs=2",
                 "--set", f"output={tmp_path / str(rank)}"] for rank in (0, 1)]
    codes, outputs, seen = watch(commands, {**single_node_env(port), "MASTER_ADDR": name})
    assert codes == [0, 0], outputs[0][1][-2000:]
    assert f"{address}:{port}" in seen, seen  # the store was seen listening there
    assert not any(a.startswith(("0.0.0.0:", ":::")) for a in seen), seen
    assert f"rendezvous listens on {address}:{port} (single node: " in outputs[0][1]


def test_tf_multiworker_says_where_tensorflow_listens_and_keeps_polytrains_own_sockets_on_loopback(
        tmp_path: Path) -> None:
    """TensorFlow binds its gRPC worker server to 0.0.0.0 with no option to narrow it: rank 0's log
    says so, and every other socket of the job (the watchdog's store) listens on loopback."""
    pytest.importorskip("tensorflow")
    port = free_port()
    commands = [[sys.executable, "-m", "polytrain.cli", "train", "--set", "framework=tensorflow",
                 "--set", "backend=tf-multiworker", "--set", "loop.epochs=1",
                 "--set", f"output={tmp_path / str(rank)}"] for rank in (0, 1)]
    codes, outputs, seen = watch(commands, single_node_env(port))
    assert codes == [0, 0], outputs[0][1][-2000:]
    # worker r listens on master_port + 1 + r, on every interface (IPv6's :: covers IPv4 too)
    grpc = {address for address in seen if address.rsplit(":", 1)[1] in (str(port + 1), str(port + 2))}
    assert len(grpc) == 2 and all(a.startswith(("0.0.0.0:", ":::")) for a in grpc), seen
    assert all(address.startswith("127.0.0.1:") for address in seen - grpc), seen
    assert f"rendezvous listens on all interfaces, port {port + 1} (TensorFlow's gRPC worker server" in outputs[0][1]
