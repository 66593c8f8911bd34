"""The worker's client of the elastic driver's store, against a real TCPStore, and the environment class that
makes an elastic worker's World its spawn-time assignment."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore

from polytrain.comm import membership
from polytrain.comm.membership import Assignment, JobEnded, Membership
from polytrain.environments import PRECEDENCE, ElasticEnvironment, detect
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World

SLOTS = {
    "localhost:0": {"rank": 0, "local_rank": 0, "local_size": 2, "cross_rank": 0, "cross_size": 2,
                    "hostname": "localhost"},
    "localhost:1": {"rank": 1, "local_rank": 1, "local_size": 2, "cross_rank": 0, "cross_size": 1,
                    "hostname": "localhost"},
    "127.0.0.1:0": {"rank": 2, "local_rank": 0, "local_size": 1, "cross_rank": 1, "cross_size": 2,
                    "hostname": "127.0.0.1"},
}


@pytest.fixture()
def driver_store():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield store, PrefixStore(membership.PREFIX, store)


def _client(store: TCPStore, slot: str) -> Membership:
    env = {membership.STORE_VARIABLE: f"127.0.0.1:{store.port}", membership.SLOT_VARIABLE: slot,
           membership.VERSION_VARIABLE: "0", membership.TIMEOUT_VARIABLE: "5"}
    client = Membership.from_env(env)
    assert client is not None
    return client


def _publish(keys: PrefixStore, version: int, slots: dict) -> None:
    keys.set(f"v/{version}", json.dumps({"size": len(slots), "slots": slots}))
    keys.set("version", str(version))


def test_assignment_leave_next_and_removal(driver_store) -> None:
    store, keys = driver_store
    _publish(keys, 0, SLOTS)
    worker = _client(store, "127.0.0.1:0")
    assert worker.latest_version() == 0
    assert worker.assignment(0) == Assignment(0, "127.0.0.1:0", 2, 3, 0, 1, 1, 2, "127.0.0.1")
    assert worker.assignment(0).horovod_env()["HOROVOD_CROSS_RANK"] == "1"
    worker.leave(0)
    assert keys.get("left/0/127.0.0.1:0") == b"1"  # what the driver reads to count the worker ready

    survivors = {"127.0.0.1:0": dict(SLOTS["127.0.0.1:0"], rank=0, cross_rank=0, cross_size=1)}
    threading.Timer(0.2, _publish, (keys, 1, survivors)).start()
    got = worker.next(0, timeout_s=10)  # blocks until the driver publishes round 1
    assert (got.version, got.rank, got.size) == (1, 0, 1)
    assert _client(store, "localhost:1").next(0, timeout_s=10) is None  # not in round 1: removed, exit 0
    with pytest.raises(TimeoutError):
        worker.next(1, timeout_s=0.1)


def test_job_end_releases_a_waiting_worker(driver_store) -> None:
    store, keys = driver_store
    _publish(keys, 0, SLOTS)
    worker = _client(store, "localhost:0")
    assert worker.ended() is None
    keys.set("end", json.dumps({"ok": False, "line": "reset limit 1 exceeded"}))
    with pytest.raises(JobEnded) as ended:
        worker.next(0, timeout_s=10)
    assert (ended.value.ok, ended.value.code, ended.value.line) == (False, 1, "reset limit 1 exceeded")


def test_a_final_round_is_the_end_unless_the_worker_writes_its_commit_there(driver_store) -> None:
    """A final round (too few slots: only for the survivors to write their last commit) ends the job for a client
    that cannot write one (``hvd.elastic``: `JobEnded`, its line), and is a round for one that can (``final``)."""
    store, keys = driver_store
    _publish(keys, 0, SLOTS)
    line = "min-np 3 not met within --elastic-timeout 1 s: 1 slots available; lost localhost (blacklisted)"
    keys.set("v/1", json.dumps({"size": 1, "final": line,
                                "slots": {"127.0.0.1:0": dict(SLOTS["127.0.0.1:0"], rank=0, cross_rank=0)}}))
    worker = _client(store, "127.0.0.1:0")
    with pytest.raises(JobEnded) as ended:
        worker.next(0, timeout_s=10)
    assert (ended.value.ok, ended.value.line) == (False, line)
    got = worker.next(0, timeout_s=10, final=True)
    assert (got.version, got.rank, got.size, got.final) == (1, 0, 1, line)
    assert worker.assignment(0).final is None


def test_hosts_update(driver_store) -> None:
    store, keys = driver_store
    worker = _client(store, "localhost:0")
    assert worker.hosts_update() is None
    keys.set("hosts", json.dumps({"ts": time.time(), "flags": membership.ADDED}))
    # TCPStore's set waits for no answer: another connection's check may reach the server first (CI saw None
    # here). A get on the setter's own connection returns once the server has applied the set.
    keys.get("hosts")
    ts, flags = worker.hosts_update()
    assert ts > 0 and flags == membership.ADDED


def test_not_elastic_without_the_driver_variables() -> None:
    assert Membership.from_env({"HOROVOD_RANK": "0"}) is None
    with pytest.raises(ValueError, match="POLYTRAIN_ELASTIC_STORE"):
        membership.split_address("nohostport")


ELASTIC_ENV = {
    "POLYTRAIN_ELASTIC_STORE": "10.0.0.5:4242", "POLYTRAIN_ELASTIC_SLOT": "127.0.0.1:0",
    "POLYTRAIN_ELASTIC_VERSION": "1", "HOROVOD_ELASTIC": "1", "HOROVOD_CONTROLLER": "gloo",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.5", "HOROVOD_HOSTNAME": "127.0.0.1", "HOROVOD_RANK": "2",
    "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "1",
    "HOROVOD_CROSS_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
}


def test_elastic_worker_world_is_its_spawn_assignment() -> None:
    assert PRECEDENCE[0] is ElasticEnvironment  # before horovodrun-gloo, whose variables it also has
    assert detect(ELASTIC_ENV) == World(rank=2, size=3, local_rank=0, local_size=1, node_rank=1, num_nodes=2,
                                        master_addr="10.0.0.5", master_port=4242, launcher="polytrain-elastic")


@pytest.mark.parametrize(("name", "value", "message"), [
    ("POLYTRAIN_ELASTIC_STORE", "nowhere", "POLYTRAIN_ELASTIC_STORE='nowhere' is not ADDR:PORT"),
    ("POLYTRAIN_ELASTIC_SLOT", "h1", "POLYTRAIN_ELASTIC_SLOT='h1' is not HOST:LOCAL_RANK"),
    ("HOROVOD_RANK", "3", "HOROVOD_RANK=3 contradicts HOROVOD_SIZE=3"),
    ("POLYTRAIN_ELASTIC_VERSION", "x", "POLYTRAIN_ELASTIC_VERSION='x' is not an integer"),
])
def test_bad_elastic_variables_are_one_line(name: str, value: str, message: str) -> None:
    with pytest.raises(EnvironmentDetectionError, match=message.replace("(", r"\(")):
        detect({**ELASTIC_ENV, name: value})
