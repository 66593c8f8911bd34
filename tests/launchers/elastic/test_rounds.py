"""The driver's rounds with a real store and real (tiny, shell) worker processes; this test plays the workers'
store side (``left/{N}/{slot}``) itself. The torch workers' side: tests/multiproc/test_elastic_driver.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore

from polytrain.launchers.elastic.driver import Driver
from polytrain.launchers.elastic.hosts import ADDED
from polytrain.launchers.elastic.options import ElasticOptions
from polytrain.launchers.elastic.workers import Worker

pytestmark = pytest.mark.timeout(60)


class Hosts:
    """Discovery whose hosts the test changes."""

    def __init__(self, hosts: dict[str, int]) -> None:
        self.hosts = hosts

    def check(self) -> None:
        return None

    def find(self) -> dict[str, int]:
        return dict(self.hosts)


class Job:
    def __init__(self, tmp_path, hosts, commands, **options) -> None:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        client = TCPStore("127.0.0.1", self.store.port, is_master=False, timeout=timedelta(seconds=20))
        self.keys = PrefixStore("polytrain/elastic", client)  # the workers' side: a connection of its own
        self.discovery = Hosts(hosts)
        self.commands = commands  # slot -> shell command (the default: wait for the file "<slot>.go")
        self.tmp = tmp_path
        self.started: list[tuple[str, dict[str, str]]] = []
        self.procs: list[subprocess.Popen] = []
        options.setdefault("np", sum(hosts.values()))
        options.setdefault("min_np", options["np"])
        self.driver = Driver(ElasticOptions(**options), self.discovery, self.store, "127.0.0.1:1", self.start, 0.05,
                             group_timeout_s=30)
        self.driver.end_grace_s = 0.2  # the shell workers never see the end key: kill them soon

    def start(self, slot, env) -> Worker:
        go = self.tmp / f"{slot.key}.go"
        command = self.commands.get(slot.key, f"while [ ! -f '{go}' ]; do sleep 0.02; done")
        proc = subprocess.Popen(["sh", "-c", command], start_new_session=True)
        self.started.append((slot.key, dict(env)))
        self.procs.append(proc)
        return Worker(slot.key, slot.hostname, slot.local_rank, slot.rank, proc)

    def run(self) -> int:
        code = self.driver.run()
        assert all(proc.poll() is not None for proc in self.procs)  # nothing left running
        return code

    def wait_version(self, version: int) -> dict:
        self.keys.wait([f"v/{version}"])
        return json.loads(self.keys.get(f"v/{version}"))

    def end(self) -> dict:
        return json.loads(self.keys.get("end"))


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_all_succeed(tmp_path):
    job = Job(tmp_path, {"a": 2}, {"a:0": "exit 0", "a:1": "exit 0"})
    assert job.run() == 0 and job.end()["ok"]
    assert [(key, env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env["POLYTRAIN_ELASTIC_VERSION"])
            for key, env in job.started] == [("a:0", "0", "2", "0"), ("a:1", "1", "2", "0")]


def test_failure_blacklists_the_host_then_reset_limit(tmp_path, capsys):
    job = Job(tmp_path, {"a": 1, "b": 2}, {"b:0": "exit 5"}, np=3, min_np=1, reset_limit=0)
    job.driver.straggler_s = 0.5  # b:1 never leaves (stuck in a collective): killed, which ends the round

    def worker_a():
        job.wait_version(0)
        job.keys.set("left/0/a:0", "1")  # a's worker saw its peer gone and left the round

    in_thread(worker_a)
    assert job.run() == 1
    assert job.end() == {"ok": False, "line": "reset limit 0 exceeded (Horovod was shutdown because number of "
                                              "resets during elastic job exceeded limit: 0)"}
    err = capsys.readouterr().err
    assert "b[1] did not leave round 0 within 0.5 s after its peers: killed" in err
    assert "blacklisted host b: b[0] (rank 1) exited with code 5" in err
    assert job.driver.blacklist.is_out("b") and not job.driver.blacklist.is_out("a")


def test_survivors_renumbered_then_min_np_not_met(tmp_path, capsys):
    job = Job(tmp_path, {"a": 1, "b": 1, "c": 1}, {"b:0": "exit 7"}, np=3, min_np=2, elastic_timeout_s=0.3)

    def workers():
        job.wait_version(0)
        job.keys.set("left/0/a:0", "1")
        job.keys.set("left/0/c:0", "1")
        v1 = job.wait_version(1)
        assert v1["size"] == 2 and {k: s["rank"] for k, s in v1["slots"].items()} == {"a:0": 0, "c:0": 1}
        job.discovery.hosts = {"a": 1}  # c goes away: both workers were told, both leave the round
        job.keys.set("left/1/a:0", "1")
        job.keys.set("left/1/c:0", "1")
        final.update(job.wait_version(2))  # a final round of the one left, to write its last commit
        (tmp_path / "a:0.go").touch()  # ... which it did, and exited

    final: dict = {}
    in_thread(workers)
    assert job.run() == 1
    line = job.end()["line"]
    assert line.startswith("min-np 2 not met within --elastic-timeout 0.3 s: 1 slots available; lost ")
    assert line.endswith("lost c (no longer discovered)")  # b was lost in the round before
    assert final["final"] == line and final["size"] == 1 and list(final["slots"]) == ["a:0"]
    assert "a final round of the 1 left, to write their last commit" in capsys.readouterr().err
    assert len(job.started) == 3  # nobody new was started


def test_every_host_blacklisted(tmp_path):
    job = Job(tmp_path, {"a": 2}, {"a:0": "exit 9"}, min_np=1)
    in_thread(lambda: (job.wait_version(0), job.keys.set("left/0/a:1", "1")))
    assert job.run() == 1
    assert job.end()["line"] == "every host is blacklisted: a (exit code 9)"


def test_every_worker_failed_names_the_first(tmp_path):
    job = Job(tmp_path, {"a": 1, "b": 1}, {"a:0": "exit 4", "b:0": "sleep 0.5; exit 6"}, min_np=1)
    assert job.run() == 1
    assert job.end()["line"] == "every worker failed; the first: a[0] (rank 0) with exit code 4"


def test_host_added_is_announced_and_joins_the_next_round(tmp_path, monkeypatch):
    job = Job(tmp_path, {"a": 1}, {}, np=1, min_np=1, max_np=4)
    seen = {}

    def workers():
        job.wait_version(0)
        job.discovery.hosts = {"a": 1, "b": 2}
        job.keys.wait(["hosts"])
        seen["hosts"] = json.loads(job.keys.get("hosts"))
        job.keys.set("left/0/a:0", "1")  # rank 0 read it, the ranks agreed, they left at a commit
        seen["v1"] = job.wait_version(1)
        for slot in ("a:0", "b:0", "b:1"):
            (tmp_path / f"{slot}.go").touch()

    thread = in_thread(workers)
    assert job.run() == 0
    thread.join()
    assert seen["hosts"]["flags"] == ADDED and seen["hosts"]["ts"] > 0
    assert {k: s["rank"] for k, s in seen["v1"]["slots"].items()} == {"a:0": 0, "b:0": 1, "b:1": 2}
    assert [(key, env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env["POLYTRAIN_ELASTIC_VERSION"])
            for key, env in job.started] == [("a:0", "0", "1", "0"), ("b:0", "1", "3", "1"), ("b:1", "2", "3", "1")]


def test_blacklisted_host_comes_back_after_its_cooldown(tmp_path):
    job = Job(tmp_path, {"a": 1, "b": 1}, {"b:0": "exit 3"}, np=2, min_np=1, cooldown=(1, 1))
    seen = {}

    def workers():
        job.wait_version(0)
        job.keys.set("left/0/a:0", "1")
        seen["v1"] = job.wait_version(1)
        job.keys.wait(["hosts"])  # b's cooldown is over: announced as added
        seen["hosts"] = json.loads(job.keys.get("hosts"))
        job.commands["b:0"] = "exit 0"
        job.keys.set("left/1/a:0", "1")
        seen["v2"] = job.wait_version(2)
        (tmp_path / "a:0.go").touch()

    thread = in_thread(workers)
    assert job.run() == 0
    thread.join()
    assert list(seen["v1"]["slots"]) == ["a:0"] and seen["hosts"]["flags"] == ADDED
    assert {k: s["rank"] for k, s in seen["v2"]["slots"].items()} == {"a:0": 0, "b:0": 1}
    assert [(key, env["POLYTRAIN_ELASTIC_VERSION"]) for key, env in job.started] == [
        ("a:0", "0"), ("b:0", "0"), ("b:0", "2")]  # a new worker on the host back in


def test_sigterm_stops_every_worker(tmp_path, capsys):
    job = Job(tmp_path, {"a": 2}, {})

    def stop():
        job.wait_version(0)
        os.kill(os.getpid(), signal.SIGTERM)

    in_thread(stop)
    assert job.run() == 128 + signal.SIGTERM  # and Job.run checked that no worker is left
    assert f"stopped by signal {int(signal.SIGTERM)}" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) != job.driver._on_signal  # the handler before is back
