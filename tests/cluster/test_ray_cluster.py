"""``polytrain launch --launcher ray --ray-address`` on a real 2-node Ray cluster (issue 30): ``ray start --head`` on
h1, ``ray start --address`` on h2, one CPU each, so the two workers land on different hosts and the job's traffic
crosses the bridge (the rendezvous names a host's address, never loopback). The cluster uses Ray's token
authentication with a token file of its own (0600, named by ``RAY_AUTH_TOKEN_PATH``; no secret on a command line).

- A 2-host job trains exactly what the same spec trains on 2 processes of one host under torchrun.
- On 3 hosts (one CPU each), the node of a worker killed mid-training with ``--max-restarts 1``: the two workers
  still fit the nodes left, so Ray restarts the group there and the job resumes from its newest checkpoint and
  ends with the weights of the uninterrupted run; the test prints the time from the kill to the job's end.
- ``polytrain sweep --ray-address`` on the 2 nodes: its 2 trials (one CPU each) run one on each host, and the
  table and CSV say which.
- h2's node killed mid-training (every Ray and job process on it SIGKILLed) with ``--max-restarts 1``: the two
  workers no longer fit the one CPU left, and the job ends with one line saying so — Ray's default would retry the
  worker group for ever — with no job process left on h1. Ray is told to wait 10 s for a group to start
  (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s by default) to keep the test short; the test prints the time
  from the kill to the launcher's exit.
"""

from __future__ import annotations

import contextlib
import csv
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from jobs import SPEC, launch, sets
from procs import check, read_metrics, train

from polytrain.checkpoint.store import read_model

pytest.importorskip("ray.train")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

RAY = str(Path(sys.executable).parent / "ray")
PORT = 6391
EPOCHS = ("loop.epochs=2",)


@contextlib.contextmanager
def ray_on(cluster, tmp_path: Path, **env: str) -> Iterator[dict[str, str]]:
    """A Ray head on the first host and a worker node on each other one (one CPU each); the environment that
    reaches it. Killed after, its session files removed."""
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    os.chmod(token, 0o600)
    # RAY_worker_niceness=0: Ray runs its workers (and so the job's ranks) at nice 15, which on a dedicated node
    # costs nothing; these nodes share the CPUs with the rest of the suite, whose processes would starve them (the
    # job then never reached its first epoch: CI, and a run beside two busy loops)
    env = cluster.env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_DEDUP_LOGS="0",
                      RAY_worker_niceness="0", **env)
    head, *others = cluster.hosts
    common = ["--num-cpus=1", "--disable-usage-stats"]
    temp = tempfile.mkdtemp(prefix="ptray-")  # short: Ray's socket paths live under it
    try:
        for host, args in ((head, ["--head", f"--port={PORT}", "--include-dashboard=false", f"--temp-dir={temp}"]),
                           *((host, [f"--address={head.addr}:{PORT}"]) for host in others)):
            started = host.run([RAY, "start", f"--node-ip-address={host.addr}", *args, *common], env=env, check=False)
            assert started.returncode == 0, f"ray start on {host.name}:\n{started.stdout[-2000:]}{started.stderr[-3000:]}"
        yield env
    finally:
        for host in reversed(cluster.hosts):  # SIGKILL, within the host's namespace (`ray stop` would stop any Ray)
            host.kill_all()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def ray_cluster(cluster, tmp_path: Path) -> Iterator[dict[str, str]]:
    """h1 (head) and h2; a worker group that cannot start is given up after 10 s."""
    with ray_on(cluster, tmp_path, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="10") as env:
        yield env


def ray_job(cluster, env: dict[str, str], out: Path, *extra: str, flags: tuple[str, ...] = ()):
    return launch(cluster, "launch", "--launcher", "ray", "--ray-address", f"{cluster.hosts[0].addr}:{PORT}", "-np",
                  "2", *flags, str(SPEC), *sets(f"output={out}", *extra), env=env)


def test_a_two_host_job_trains_what_one_host_trains_and_a_lost_node_ends_it_in_one_line(
        cluster, ray_cluster: dict[str, str], tmp_path: Path) -> None:
    """One Ray cluster for both halves (each test gets its hosts' processes killed after it)."""
    job = ray_job(cluster, ray_cluster, tmp_path / "ray", *EPOCHS).check(timeout=300)
    addresses = {host.addr for host in cluster.hosts}
    assert any(f"multi-node: the address {addr} names here" in job.stdout + job.stderr for addr in addresses), \
        job.text()
    reference = train(tmp_path / "one-host", EPOCHS, spec=SPEC, launcher="torchrun", nproc=2)
    assert reference.returncode == 0, reference.stderr[-3000:]
    got, manifest = read_model(tmp_path / "ray")
    want, _ = read_model(tmp_path / "one-host")
    assert manifest["world_size"] == 2 and sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)

    out = tmp_path / "out"
    job = ray_job(cluster, ray_cluster, out, "loop.epochs=300", flags=("--max-restarts", "1"))
    job.wait_for(r"epoch 1: train loss", timeout=200)  # a worker's line, passed on by Ray (RAY_DEDUP_LOGS=0)
    h1, h2 = cluster.hosts
    assert h2.kill_all(), "nothing ran on h2"
    killed = time.monotonic()
    code = job.wait(timeout=240)
    print(f"\nray, h2's node killed: the launcher exited {code} after {time.monotonic() - killed:.1f} s")
    assert code == 1, job.text()
    assert "polytrain: the Ray job failed: Ray could not place the 2 workers within 10 s: the cluster has no room " \
           "for them (a node lost" in job.stderr, job.text()
    time.sleep(1)  # the failed rank's process ends with its worker actor
    assert not [cmd for cmd in h1.commands().values() if "polytrain.cli train" in cmd], h1.commands()


def test_a_lost_node_whose_workers_fit_the_nodes_left_restarts_there_and_ends_with_the_uninterrupted_weights(
        cluster3, tmp_path: Path) -> None:
    keep = ("loop.epochs=8", "checkpoint.every_n_steps=10", "schedule.decay=none")
    with ray_on(cluster3, tmp_path) as env:
        out = tmp_path / "out"
        job = ray_job(cluster3, env, out, *keep, flags=("--max-restarts", "1"))
        job.wait_for(r"epoch 1: train loss", timeout=200)
        head, *others = cluster3.hosts
        victims = [host for host in others if any("polytrain.cli train" in cmd for cmd in host.commands().values())]
        assert victims, "no worker on h2 or h3:\n" + job.text()
        victim = victims[0]  # a node the head is not on: the job's driver and Ray's controller stay up
        assert victim.kill_all(), f"nothing ran on {victim.name}"
        killed = time.monotonic()
        code = job.wait(timeout=300)
        print(f"\nray, {victim.name}'s node killed: the job ended {code} {time.monotonic() - killed:.1f} s later")
        assert code == 0, job.text()
    resumes = read_metrics(out, "resume")
    assert len(resumes) == 1 and resumes[0]["step"] % 10 == 0 and resumes[0]["step"] >= 20, resumes
    reference = train(tmp_path / "one-host", keep, spec=SPEC, launcher="torchrun", nproc=2)
    assert reference.returncode == 0, reference.stderr[-3000:]
    got, manifest = read_model(out)
    want, _ = read_model(tmp_path / "one-host")
    assert manifest["world_size"] == 2 and sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_sweep_on_the_two_node_cluster_runs_a_trial_on_each_host(cluster, ray_cluster: dict[str, str],
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = launch(cluster, "sweep", str(SPEC), "--grid", "optimizer.lr=0.02,0.05", "--ray-address",
                  f"{cluster.hosts[0].addr}:{PORT}", *sets(f"output={out}", *EPOCHS), env=ray_cluster).check(timeout=300)
    rows = list(csv.DictReader((out / "sweep" / "sweep.csv").open()))
    assert [row["status"] for row in rows] == ["done", "done"], done.text()
    assert sorted(row["node"] for row in rows) == sorted(host.addr for host in cluster.hosts), rows
    for row in rows:  # each trial trained what its point's run on one process of this host trains
        alone = tmp_path / f"alone-{row['trial']}"
        check(train(alone, [f"optimizer.lr={row['optimizer.lr']}", *EPOCHS], spec=SPEC))
        assert float(row["val_accuracy"]) == max(r["val_accuracy"] for r in read_metrics(alone, "epoch")), row
    best = [row for row in rows if row["best"] == "True"]
    assert len(best) == 1 and float(best[0]["val_accuracy"]) == max(float(row["val_accuracy"]) for row in rows)
    assert all(host.addr in done.stdout for host in cluster.hosts), done.stdout  # the table's node column
