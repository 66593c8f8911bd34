"""A real Slurm on the cluster of network namespaces: slurmctld on h1, a slurmd on h1 and h2 (see slurm.py).

- `polytrain launch --emit-sbatch` writes a script that ``sbatch`` runs across both hosts; the output shows
  the Slurm environment polytrain detected from real srun variables, and the replicas end identical.
- ``srun -N2 -n3`` (tasks per node 2,1): every rank's local size is the number of tasks on its own node.
- A host's ranks SIGKILLed: the job ends non-zero, Slurm names the killed tasks, nothing is left.
- A hand-written loop on `polytrain.torch.Distributed` (tests/multiproc/own_loop_worker.py) as one rank per
  host under ``srun -N2 -n2``: the same losses and weights as the loop in one process.
- Preemption: ``--emit-sbatch --requeue --signal USR1@60`` jobs stopped mid-run by the batch shell's SIGUSR1
  (``scancel --batch --signal``) and by ``scontrol requeue`` are requeued and end on the uninterrupted weights.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from jobs import REPO, SPEC, WORKER_MARK, sets, trained
from netns import Cluster
from procs import read_metrics
from slurm import SlurmCluster, slurm_unavailable

from polytrain.checkpoint.store import read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

PROBE = str(Path(__file__).resolve().parent / "world_probe.py")
OWN_LOOP = str(REPO / "tests" / "multiproc" / "own_loop_worker.py")


@pytest.fixture(scope="module")
def slurm_daemons(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = slurm_unavailable()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    daemons = SlurmCluster(cluster, tmp_path_factory.mktemp("slurm"))
    try:
        daemons.start()
        yield daemons
    finally:
        daemons.stop()


@pytest.fixture
def slurm(slurm_daemons: SlurmCluster) -> SlurmCluster:
    """The module's daemons, restarted if the cluster's per-test clean-up ended them (it kills every process
    in the namespaces but sshd); munged runs outside the namespaces and stays."""
    return slurm_daemons.ensure()


def emit_sbatch(path: Path, out: Path, *settings: str, flags: tuple[str, ...] = ()) -> str:
    done = subprocess.run([sys.executable, "-m", "polytrain.cli", "launch", "--emit-sbatch", str(path), "-np", "4",
                           "-H", "h1:2,h2:2", *flags, str(SPEC), *sets(f"output={out}", *settings)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return path.read_text()


@pytest.fixture(scope="module")
def plain_job(slurm_daemons: SlurmCluster, cluster: Cluster,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], str, Path]:
    """The emitted job, 60 steps on 4 ranks over 2 hosts, never interrupted: its final state, log and output
    (the reference of the preemption tests too)."""
    slurm = slurm_daemons.ensure()
    tmp = tmp_path_factory.mktemp("plain")
    out, log = tmp / "run", tmp / "job.out"
    script = emit_sbatch(tmp / "job.sh", out, "loop.max_steps=60")
    assert "--nodelist=h1,h2" in script and "srun " in script
    job = slurm.sbatch(tmp / "job.sh", f"--output={log}", f"--chdir={REPO}")
    state = slurm.wait_job(job, timeout=240)
    assert slurm.wait_no_processes(30) == {}, "processes left on the hosts"
    return state, log.read_text(), out


def probes(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def test_emitted_sbatch_runs_across_two_hosts(slurm: SlurmCluster, plain_job: tuple) -> None:
    state, text, out = plain_job
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), f"{state}\n{text}\n{slurm.logs()}"
    assert state["NodeList"] == "h[1-2]"
    assert slurm.jobs() == [], "squeue still lists jobs"
    # detected from the real srun variables: launcher slurm, 4 ranks over 2 nodes, master the job's first node
    assert "torch/ddp on 4 process(es) (launcher: slurm)" in text, text
    # the master is the job's first node, and rank 0's store listens on h1's cluster address, not everywhere
    assert f"rendezvous listens on {slurm.cluster.hosts[0].addr}:" in text, text
    assert "(multi-node: the address h1 names here)" in text, text
    trained(out, 4, "ddp")


#: how a running job is preempted: (the command, the signal the ranks see, what rank 0's line ends with)
PREEMPTIONS = {
    # what --signal=B:USR1@N does at the time limit: the batch shell gets it and passes it on
    "the batch shell's SIGUSR1": (["scancel", "--batch", "--signal=USR1"], "SIGUSR1", "; Slurm job {job} requeued"),
    # an administrator's or the scheduler's requeue: SIGTERM to every task (KillWait later, SIGKILL)
    "scontrol requeue": (["scontrol", "requeue"], "SIGTERM", "; Slurm job {job} was requeued already"),
}
HOLD_AT = 15  # the step every rank waits at until the signal reached it (hold_for_signal.py)


def while_queued(slurm: SlurmCluster, job: str, ready: Callable[[], bool], what: str, log: Path,
                 guard_s: float = 300) -> None:
    """Wait until ``ready()``; the job must stay queued meanwhile. ``guard_s`` only ends a hang."""
    deadline = time.monotonic() + guard_s
    while not ready():
        assert job in slurm.jobs(), f"job {job} ended before: {what}\n" + (log.read_text() if log.exists() else "")
        if time.monotonic() > deadline:  # a hang guard, not a measurement
            pytest.fail(f"job {job}: not {what} after {guard_s:g} s: hung?\n{slurm.job_state(job)}")
        time.sleep(0.1)


@pytest.mark.timeout(600)  # two runs of the job and a requeue: a hang guard with room for a loaded machine
@pytest.mark.parametrize("how", list(PREEMPTIONS))
def test_a_preempted_job_is_requeued_and_ends_on_the_uninterrupted_weights(
        slurm: SlurmCluster, plain_job: tuple, tmp_path: Path, how: str) -> None:
    """`--emit-sbatch --requeue --signal USR1@60`: the job stops at the first logging window after the signal (every
    rank at the same step, its checkpoint written there), is requeued, starts again with ``--resume auto`` and
    ends on exactly the weights of the job never interrupted: no step lost, none run twice."""
    command, signal_name, requeued = PREEMPTIONS[how]
    _, _, reference = plain_job
    out, log, hold = tmp_path / "run", tmp_path / "job.out", tmp_path / "hold"
    hold.mkdir()
    script = emit_sbatch(tmp_path / "job.sh", out, "loop.max_steps=60", "callbacks=[hold_for_signal:HoldForSignal]",
                         flags=("--requeue", "--signal", "USR1@60", "-x", f"PYTHONPATH={Path(__file__).parent}",
                                "-x", f"HOLD_AT={HOLD_AT}", "-x", f"HOLD_DIR={hold}"))
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@60" in script and "--resume auto" in script
    job = slurm.sbatch(tmp_path / "job.sh", f"--output={log}", "--open-mode=append", f"--chdir={REPO}")
    # every rank holds at HOLD_AT, so the signal lands mid-run
    while_queued(slurm, job, lambda: len(list(hold.iterdir())) == 4, f"every rank at step {HOLD_AT}", log)
    slurm.command(*command, job)
    while_queued(slurm, job, lambda: slurm.job_state(job).get("JobState") == "PENDING", "stopped and requeued", log)
    # Slurm holds a requeued job back for about two minutes (its begin time); start it now, as an admin may
    slurm.command("scontrol", "update", f"JobId={job}", "StartTime=now")
    state = slurm.wait_job(job, timeout=400)
    text = log.read_text()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        f"{state}\n{text}\n{slurm.logs()}"
    closes = [r["step"] for r in read_metrics(reference, "step")]
    stop = min(c for c in closes if c > HOLD_AT)  # the first logging window after the hold
    line = (f"polytrain: preempted by {signal_name}: every rank stopped after step {stop}, its checkpoint written "
            f"at step {stop}; resume with --resume auto{requeued.format(job=job)}")
    assert line in text.splitlines(), text
    records = read_metrics(out)
    resumed = [i for i, r in enumerate(records) if r.get("event") == "resume"]
    assert [records[i]["step"] for i in resumed] == [stop], records
    before = [r["step"] for r in records[:resumed[0]] if r.get("event") == "step"]
    after = [r["step"] for r in records[resumed[0]:] if r.get("event") == "step"]
    assert before == [c for c in closes if c <= stop], (before, closes)  # nothing logged past the stop
    assert after and after[0] > stop and after == sorted(set(after)), after  # none twice
    got, ref = read_model(out)[0], read_model(reference)[0]
    assert sorted(got) == sorted(ref)
    # 4 ranks: a resumed run need not sum each gradient's four parts in the straight run's order (a fresh DDP
    # reducer buckets its first step in another order than the rebuilt buckets of a long run), so its weights may
    # differ in the last bits (measured here: up to 3e-7 after 60 steps, under torchrun on one host as under srun;
    # 0 with 2 ranks, one addition per element); a lost or repeated step moves them by orders of magnitude more
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    trained(out, 4, "ddp")
    assert slurm.wait_no_processes(30) == {}, "processes left on the hosts"


def test_srun_uneven_tasks_per_node(slurm: SlurmCluster, cluster: Cluster, tmp_path: Path) -> None:
    """``srun -N2 -n3`` puts 2 tasks on h1 and 1 on h2: each rank's local size is its own node's count."""
    h1 = cluster.hosts[0]
    (tmp_path / "probe").mkdir()
    done = h1.run(["srun", "-N2", "-n3", "--kill-on-bad-exit=1", sys.executable, PROBE, str(tmp_path / "probe")],
                  env=slurm.env(), cwd=REPO, check=False, timeout=120)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    seen = probes(tmp_path / "probe")
    assert sorted(p["world"]["rank"] for p in seen) == [0, 1, 2]
    per_host = {h: sorted(p["world"]["local_rank"] for p in seen if p["host"] == h) for h in ("h1", "h2")}
    assert per_host == {"h1": [0, 1], "h2": [0]}, per_host
    for p in seen:
        world = p["world"]
        assert p["env"]["SLURM_STEP_TASKS_PER_NODE"] == "2,1"
        assert (world["launcher"], world["size"], world["num_nodes"]) == ("slurm", 3, 2)
        assert world["local_size"] == len(per_host[p["host"]]), p
        assert world["node_rank"] == ["h1", "h2"].index(p["host"]), p
        assert world["master_addr"] == "h1", p
    out = tmp_path / "run"
    done = h1.run(["srun", "-N2", "-n3", "--kill-on-bad-exit=1", sys.executable, "-m", "polytrain.cli", "train",
                   str(SPEC), *sets(f"output={out}", "loop.max_steps=60")], env=slurm.env(), cwd=REPO,
                  check=False, timeout=240)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "torch/ddp on 3 process(es) (launcher: slurm)" in done.stdout + done.stderr
    trained(out, 3, "ddp")


def test_own_loop_one_rank_per_host_under_srun(slurm: SlurmCluster, cluster: Cluster, tmp_path: Path) -> None:
    """The own-loop API under srun, across two hosts (backend ddp, the master the job's first node): every
    micro-step's loss and the final weights equal the same loop in one process."""
    h1 = cluster.hosts[0]
    runs = {"one": ([sys.executable], "local"), "srun": (["srun", "-N2", "-n2", "--kill-on-bad-exit=1", sys.executable],
                                                        "ddp")}
    got = {}
    for name, (start, backend) in runs.items():
        out = tmp_path / f"{name}.json"
        done = h1.run([*start, OWN_LOOP, backend, str(out)], env=slurm.env(), cwd=REPO, check=False, timeout=180)
        assert done.returncode == 0, f"{name}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        got[name] = json.loads(out.read_text())
    one, two = got["one"], got["srun"]
    assert (two["launcher"], two["backend"], two["world"]) == ("slurm", "ddp", 2)
    assert len(two["losses"]) == len(one["losses"]) == 40
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(two["norms"], one["norms"], rtol=1e-5)
    for name, values in one["weights"].items():
        np.testing.assert_allclose(two["weights"][name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    assert slurm.wait_no_processes(30) == {}, "processes left on the hosts"


def wait_for_step(metrics: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
        if time.monotonic() > deadline:  # a hang guard, not a measurement
            pytest.fail(f"no training step in {metrics}: the job hung or died before its first step")
        time.sleep(0.1)


def test_sigkill_of_a_hosts_ranks_ends_the_job(slurm: SlurmCluster, cluster: Cluster, tmp_path: Path,
                                               record_property) -> None:
    out, log = tmp_path / "run", tmp_path / "job.out"
    emit_sbatch(tmp_path / "job.sh", out, "loop.epochs=100000")
    job = slurm.sbatch(tmp_path / "job.sh", f"--output={log}", f"--chdir={REPO}")
    wait_for_step(out / "metrics.jsonl")
    victims = cluster.hosts[1].kill_all(WORKER_MARK)
    killed_at = time.monotonic()
    assert len(victims) == 2, victims
    state = slurm.wait_job(job, timeout=120)
    seconds = time.monotonic() - killed_at
    record_property("slurm_sigkill_to_job_end_s", round(seconds, 2))
    print(f"slurm: SIGKILL of h2's ranks -> job {job} ended in {seconds:.2f}s")
    text = log.read_text()
    print("\n".join(line for line in text.splitlines() if "error" in line or line.startswith("srun:")))
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0", f"{state}\n{text}"
    # srun names the node whose tasks were killed, and the survivors, ended by --kill-on-bad-exit: a node's tasks on
    # one line ("tasks 2-3") when they ended within one of srun's polls, else a line each, as a loaded machine has it
    def ended(host: str, how: str = "") -> set[str]:
        return set(re.findall(rf"^srun: error: {host}: tasks? (\d+(?:-\d+)?): {how}", text, re.M))

    assert ended("h2", "Killed") in ({"2-3"}, {"2", "3"}), text
    assert ended("h1") in ({"0-1"}, {"0", "1"}), text
    assert not (out / "model.safetensors").exists()
    assert slurm.wait_no_processes(60) == {}, "processes left on the hosts"
