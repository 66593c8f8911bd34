"""Re-forming the default gloo group on the elastic driver's store in one process, and telling a lost peer
from any other error. (Survivors re-forming after a real SIGKILL: tests/multiproc/test_elastic_driver.py.)"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from polytrain.adapters.torch import reform
from polytrain.comm import membership
from polytrain.comm.membership import Membership


def test_init_release_init_on_versions() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    keys = PrefixStore(membership.PREFIX, store)
    slot = {"rank": 0, "local_rank": 0, "local_size": 1, "cross_rank": 0, "cross_size": 1, "hostname": "localhost"}
    for version in (0, 1):
        keys.set(f"v/{version}", json.dumps({"size": 1, "slots": {"localhost:0": slot}}))
    worker = Membership(store, "localhost:0", 0, 5.0)
    try:
        for version in (0, 1):
            reform.init(worker, worker.assignment(version), timeout_s=5)
            total = torch.ones(2)
            dist.all_reduce(total)
            assert dist.get_world_size() == 1 and total.tolist() == [1.0, 1.0]
            reform.release()
            assert not dist.is_initialized()
        assert torch.distributed.nn.functional.all_reduce.__defaults__[-1] is None  # prepare() pinned no group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(("exc", "lost"), [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is"), True),
    (RuntimeError("[pair.cc:537] Read error [127.0.0.1]:5: Connection reset by peer."), True),
    (RuntimeError("[unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"), True),
    (dist.DistStoreError("wait timeout after 5000ms, keys: /v0/0//cpu//0/2"), True),
    (RuntimeError("CUDA out of memory"), False),
    (ValueError("Connection closed by peer"), False),
])
def test_is_peer_loss(exc: BaseException, lost: bool) -> None:
    assert reform.is_peer_loss(exc) is lost


def test_group_timeout_from_horovod_variable() -> None:
    assert reform.group_timeout_s({"HOROVOD_GLOO_TIMEOUT_SECONDS": "7"}) == 7.0
    assert reform.group_timeout_s({}) == reform.DEFAULT_GROUP_TIMEOUT_S


def test_a_round_whose_peer_is_gone_is_left_for_the_next() -> None:
    """A second loss during a recovery: the peer of round 1 never forms its group (it died after the driver
    published the round), so this worker's group init times out; it leaves round 1 and forms round 2, which the
    driver publishes once the round ended."""
    import threading
    from types import SimpleNamespace

    from polytrain.adapters.torch import elastic_group
    from polytrain.world import World

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    keys = PrefixStore(membership.PREFIX, store)
    slot = {"rank": 0, "local_rank": 0, "local_size": 1, "cross_rank": 0, "cross_size": 1, "hostname": "localhost"}
    gone = {**slot, "rank": 1, "local_rank": 1}
    keys.set("v/0", json.dumps({"size": 1, "slots": {"localhost:0": slot}}))
    keys.set("v/1", json.dumps({"size": 2, "slots": {"localhost:0": slot, "localhost:1": gone}}))

    def driver() -> None:  # round 1 ends when this worker leaves it (its peer died): round 2 without the peer
        keys.wait(["left/1/localhost:0"], timedelta(seconds=60))
        keys.set("v/2", json.dumps({"size": 1, "slots": {"localhost:0": slot}}))

    threading.Thread(target=driver, daemon=True).start()
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))  # the worker's own
    worker = Membership(client, "localhost:0", 0, 5.0)
    backend = SimpleNamespace(spec=SimpleNamespace(reliability=SimpleNamespace(collective_timeout_s=1.0)),
                              membership=worker, assignment=worker.assignment(0), _owns_group=False,
                              world=World(rank=0, size=1, launcher="polytrain-elastic"))
    try:
        got = elastic_group.reform(backend)
        assert (got.version, backend.world.size, dist.get_world_size()) == (2, 1, 1)
        assert keys.check(["left/0/localhost:0", "left/1/localhost:0"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
