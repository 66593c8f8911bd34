"""Real network faults on the 2-host cluster: a cable cut, a host's ranks SIGKILLed, packet loss and latency,
and a resume on fewer hosts. Each fault test prints its figure (time from the fault to the launcher's exit,
exit code; the slow-down under netem) — see the report of issue 19; nothing here asserts a time bound."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from jobs import SPEC, Job, launch, sets, trained, wait_no_processes, worker_pids
from procs import losses_by_step

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

TIMEOUT_S = 15
LONG = ("loop.epochs=300", f"reliability.collective_timeout_s={TIMEOUT_S}")
FIRST_EPOCH = r"^epoch 1: "


def long_job(cluster, tmp_path: Path, launcher: str, port: int) -> Job:
    args = ["launch", "--launcher", launcher, "-H", "h1:1,h2:1"]
    if launcher == "torchrun":
        args += ["--master-port", str(port)]
    job = launch(cluster, *args, str(SPEC), *sets(f"output={tmp_path / 'out'}", *LONG))
    job.wait_for(FIRST_EPOCH)
    return job


def test_link_cut_mid_training(cluster, tmp_path: Path) -> None:
    """h2's cable cut: the rank on h1 fails within the collective timeout naming the lost rank, the launcher
    exits non-zero, and no process is left on either host (h2's stop when its ssh session times out)."""
    job = long_job(cluster, tmp_path, "torchrun", 29411)
    h2 = cluster.host("h2")
    h2.link_down()
    cut = time.monotonic()
    code = job.wait(240)
    detected = time.monotonic() - cut
    left = wait_no_processes(cluster, 120)
    cleaned = time.monotonic() - cut
    print(f"\nFIGURE link cut: launcher exit {code} after {detected:.1f}s (collective timeout {TIMEOUT_S}s); "
          f"every host clean after {cleaned:.1f}s")
    assert code != 0, job.text()
    lost = [line for line in job.err if "rank 1" in line and "error" in line]
    print("\n".join(lost + [line for line in job.err if line.startswith("polytrain launch:")]))
    assert lost, job.text()
    assert "polytrain launch: rank 1 on host h2 " in job.stderr, job.text()
    assert left == {}, left


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_a_hosts_ranks_killed(cluster, tmp_path: Path, launcher: str) -> None:
    job = long_job(cluster, tmp_path, launcher, 29412)
    h2 = cluster.host("h2")
    victims = worker_pids(h2)
    assert victims, h2.commands()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    code = job.wait(240)
    detected = time.monotonic() - killed
    left = wait_no_processes(cluster, 60)
    print(f"\nFIGURE SIGKILL of h2's ranks under {launcher}: launcher exit {code} after {detected:.1f}s")
    assert code != 0, job.text()
    assert "polytrain launch: rank 1 on host h2 was killed by SIGKILL" in job.stderr, job.text()
    assert left == {}, left


SHAPES = {"netem loss 5% delay 20ms": ("netem", "loss 5% delay 20ms"), "htb 10mbit": ("htb", "10mbit")}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_degraded_link(cluster, tmp_path: Path, shape: str) -> None:
    """A lossy, slow link (netem: 5 % loss and 20 ms each way) or a narrow one (htb: 10 Mbit/s) to h2: training
    completes with identical replicas, the same weights as on a clean link."""
    kind, value = SHAPES[shape]
    h2 = cluster.host("h2")
    if not h2.qdisc_supported(kind):
        pytest.skip(f"this kernel has no {kind} qdisc (tc: 'Specified qdisc kind is unknown')")
    common = ["launch", "--launcher", "torchrun", "-H", "h1:1,h2:1", "--master-port", "29413", str(SPEC)]
    clean = launch(cluster, *common, *sets(f"output={tmp_path / 'clean'}", "loop.epochs=4")).check()
    reference = trained(tmp_path / "clean", 2, "ddp", accuracy=0.8)
    h2.netem(value) if kind == "netem" else h2.rate_limit(value)
    try:
        slow = launch(cluster, *common, *sets(f"output={tmp_path / 'slow'}", "loop.epochs=4")).check(300)
    finally:
        h2.netem(None)
    degraded = trained(tmp_path / "slow", 2, "ddp", accuracy=0.8)
    assert degraded["rank_state_digests"] == reference["rank_state_digests"]  # the same run, only slower
    print(f"\nFIGURE {shape}: {clean.seconds:.1f}s clean, {slow.seconds:.1f}s degraded "
          f"({slow.seconds / clean.seconds:.2f}x)")


RESUME = ["schedule.decay=none", "schedule.lr_scaling=none", "optimizer.name=adam", "optimizer.lr=0.003", "optimizer.momentum=0.0",
          "data.global_batch_size=64", "loop.log_every_n_steps=1", "model.params.hidden_sizes=[64]",
          "loop.epochs=3"]


@pytest.fixture(scope="module")
def two_host_checkpoint(cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """A 2-host run (1 rank per host) of 3 epochs with a checkpoint at the end of epoch 2 (step 46)."""
    reference = tmp_path_factory.mktemp("two-host") / "reference"
    launch(cluster, "launch", "--launcher", "torchrun", "-H", "h1:1,h2:1", "--master-port", "29414", str(SPEC),
           *sets(f"output={reference}", *RESUME, "checkpoint.every_n_steps=46")).check()
    checkpoint = reference / "checkpoints" / "step-00000046"
    assert checkpoint.is_dir(), sorted(p.name for p in (reference / "checkpoints").iterdir())
    return checkpoint, losses_by_step(reference)


@pytest.mark.parametrize("hosts", [1, 3])
def test_resume_on_other_hosts(request, two_host_checkpoint, tmp_path: Path, hosts: int) -> None:
    """The 2-host run's checkpoint after epoch 2, resumed on 1 host (1 rank) or 3 hosts (1 rank each): the same
    run goes on (docs/portable-state.md) — the losses after the checkpoint are the 2-host run's, the run ends
    at the same step, and on 3 hosts the replicas are identical."""
    checkpoint, ref = two_host_checkpoint
    resumed = tmp_path / "resumed"
    if hosts == 1:
        cluster = request.getfixturevalue("cluster")
        job = launch(cluster, "train", str(SPEC), *sets(f"output={resumed}", *RESUME), "--resume", str(checkpoint),
                     host=cluster.host("h2"))
    else:
        cluster = request.getfixturevalue("cluster3")
        job = launch(cluster, "launch", "--launcher", "torchrun", "-H", "h1:1,h2:1,h3:1", "--master-port", "29415",
                     str(SPEC), *sets(f"output={resumed}", *RESUME), "--resume", str(checkpoint))
    job.check()
    got = losses_by_step(resumed)
    assert min(got) == 47 and max(got) == max(ref)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [ref[s] for s in sorted(got)], rtol=2e-5)
    manifest = json.loads((resumed / "model.json").read_text())
    assert manifest["world_size"] == hosts and len(set(manifest["rank_state_digests"])) == 1
    assert wait_no_processes(cluster) == {}
