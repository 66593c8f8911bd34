"""``hvd.elastic`` on the shim under polytrain's elastic driver: a host joins a running job, a worker is SIGKILLed,
and another is preempted (SIGTERM), and the same processes go on each time (issue 50 item 2, issue 52's elastic
preemption).

One launch: ``polytrain launch --launcher horovodrun -np 2 --min-np 2 --max-np 3 --host-discovery-script``
with ``POLYTRAIN_HOROVOD_IMPL=shim``; localhost and ``127.0.0.2`` hold a slot each, and ``127.0.0.1`` appears in
the discovery script mid-epoch (Horovod's own tests use such names for hosts). The script
(workers/elastic_inplace.py) is a Horovod elastic script in its usual shape: the newcomer joins at the next
commit and gets the survivors' state, then kills itself between two commits; the two original workers roll
back to that commit and go on at size 2; in epoch 1 one of them is preempted and leaves after the next commit
(exit code 75), and the last finishes alone with nothing redone. Checked from what each process wrote: the survivors are the
processes that started, the one step after the last commit is the only one trained twice, every sample of each
epoch is trained exactly once by the committed steps, and the final weights equal those of a run that trains
those same committed steps, at those sizes, without any failure (rtol 1e-5).
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from procs import loopback_env, run

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = Path(__file__).resolve().parent / "workers" / "elastic_inplace.py"
SAMPLES, LR = 48, 0.05


def replay(steps: list[dict]) -> np.ndarray:
    """The weights after the committed steps, in order, each the average of its ranks' MSE gradients."""
    x = np.random.default_rng(0).standard_normal((SAMPLES, 4)).astype(np.float32).astype(np.float64)
    y = x @ np.array([1.0, -2.0, 3.0, 0.5])
    torch.manual_seed(0)
    w = torch.nn.Linear(4, 1, bias=False).weight.detach().double().numpy().flatten()
    by_step: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for step in steps:
        by_step[(step["epoch"], step["at"])].append(step)
    for key in sorted(by_step):
        parts = by_step[key]
        assert sorted(p["rank"] for p in parts) == list(range(parts[0]["size"])), (key, parts)
        grads = [2 * x[p["indices"]].T @ (x[p["indices"]] @ w - y[p["indices"]]) / len(p["indices"]) for p in parts]
        w = w - LR * np.mean(grads, axis=0)
    return w


def test_a_host_joins_and_a_killed_worker_is_left_behind_by_the_same_processes(tmp_path: Path) -> None:
    logs, mark = tmp_path / "logs", tmp_path / "grow"
    logs.mkdir()
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho localhost:1\necho 127.0.0.2:1\nif [ -f {mark} ]; then echo 127.0.0.1:1; fi\n")
    script.chmod(0o755)
    result = run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "horovodrun", "-np", "2",
                  "--min-np", "1", "--max-np", "3", "--host-discovery-script", str(script), str(WORKER),
                  str(logs)], timeout=240,
                 env=loopback_env(POLYTRAIN_HOROVOD_IMPL="shim", POLYTRAIN_ELASTIC_DISCOVERY_INTERVAL="0.1",
                                  HOROVOD_GLOO_TIMEOUT_SECONDS="60", ELASTIC_TEST_MARK=str(mark),
                                  ELASTIC_TEST_KILL_HOST="127.0.0.1", ELASTIC_TEST_PREEMPT_HOST="127.0.0.2",
                                  POLYTRAIN_PREEMPTION_SIGNALS="SIGTERM"))
    assert result.left_behind == [], result.left_behind
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for path in sorted(logs.glob("*.jsonl")) for line in path.read_text().splitlines()]
    by_pid: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_pid[record["pid"]].append(record)
    done = {pid for pid, rs in by_pid.items() if rs[-1]["event"] == "done"}
    sizes = {pid: [r["size"] for r in rs if r["event"] == "formed"] for pid, rs in by_pid.items()}
    # the worker that ran throughout, the one preempted in epoch 1, the newcomer that was killed: each formed its
    # groups in one process, at these sizes, and only the first finished
    assert sorted(sizes.values()) == [[2, 3, 2], [2, 3, 2, 1], [3]], sizes
    assert done == {pid for pid, s in sizes.items() if s == [2, 3, 2, 1]}
    newcomer = next(pid for pid, s in sizes.items() if s == [3])
    assert {r["size"] for r in by_pid[newcomer] if r["event"] == "trained"} == {3}
    assert "left the elastic job after its commit; the other ranks go on without it (exit code 75)" in result.stderr
    # the step after the last commit before the kill is the only one trained twice
    trained = Counter((r["pid"], r["epoch"], r["at"]) for r in records if r["event"] == "trained")
    assert {key[1:] for key, count in trained.items() if count > 1} == {(0, 36)}
    # the committed steps train every sample of each epoch exactly once
    steps = [r for r in records if r["event"] == "step"]
    for epoch in (0, 1):
        seen = sorted(i for s in steps if s["epoch"] == epoch for i in s["indices"])
        assert seen == list(range(SAMPLES)), epoch
    assert {(s["epoch"], s["at"], s["size"]) for s in steps if (s["epoch"], s["at"]) in (
        (0, 20), (0, 24), (0, 30), (0, 36), (1, 12), (1, 16))} == {
        (0, 20, 2), (0, 24, 3), (0, 30, 3), (0, 36, 2), (1, 12, 2), (1, 16, 1)}
    weight = next(r["weight"] for pid in done for r in by_pid[pid] if r["event"] == "done")
    np.testing.assert_allclose(weight, replay(steps), rtol=1e-5)
