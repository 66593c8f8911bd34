"""``hvd.elastic`` on the shim under polytrain's elastic driver: a host joins a running job and a worker is
SIGKILLed, and the same processes go on each time (issue 50, item 2).

One launch: ``polytrain launch --launcher horovodrun -np 2 --min-np 2 --max-np 3 --host-discovery-script``
with ``POLYTRAIN_HOROVOD_IMPL=shim``; localhost holds 2 slots, and ``127.0.0.1`` appears in the discovery
script mid-epoch (Horovod's own tests use the same two names for two hosts). The script
(workers/elastic_inplace.py) is a Horovod elastic script in its usual shape: the newcomer joins at the next
commit and gets the survivors' state, then kills itself between two commits; the two original workers roll
back to that commit and finish at size 2. Checked from what each process wrote: the survivors are the
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
    script.write_text(f"#!/bin/sh\necho localhost:2\nif [ -f {mark} ]; then echo 127.0.0.1:1; fi\n")
    script.chmod(0o755)
    result = run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "horovodrun", "-np", "2",
                  "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script), str(WORKER),
                  str(logs)], timeout=240,
                 env=loopback_env(POLYTRAIN_HOROVOD_IMPL="shim", POLYTRAIN_ELASTIC_DISCOVERY_INTERVAL="0.1",
                                  HOROVOD_GLOO_TIMEOUT_SECONDS="60", ELASTIC_TEST_MARK=str(mark),
                                  ELASTIC_TEST_KILL_HOST="127.0.0.1"))
    assert result.left_behind == [], result.left_behind
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for path in sorted(logs.glob("*.jsonl")) for line in path.read_text().splitlines()]
    by_pid: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_pid[record["pid"]].append(record)
    done = {pid for pid, rs in by_pid.items() if rs[-1]["event"] == "done"}
    first = {pid for pid, rs in by_pid.items() if rs[0]["event"] == "formed" and rs[0]["size"] == 2}
    joined = set(by_pid) - first
    # the two workers that started finish, in the same processes; the newcomer trained at size 3, then died
    assert len(first) == 2 and done == first and len(joined) == 1, {p: r[0] for p, r in by_pid.items()}
    newcomer = by_pid[joined.pop()]
    assert {r["size"] for r in newcomer if r["event"] == "trained"} == {3}
    assert [r["size"] for pid in first for r in by_pid[pid] if r["event"] == "formed"] == [2, 3, 2] * 2
    # the step after the last commit before the kill is the only one trained twice
    trained = Counter((r["pid"], r["epoch"], r["at"]) for r in records if r["event"] == "trained")
    assert {key[1:] for key, count in trained.items() if count > 1} == {(0, 36)}
    # the committed steps train every sample of each epoch exactly once
    steps = [r for r in records if r["event"] == "step"]
    for epoch in (0, 1):
        seen = sorted(i for s in steps if s["epoch"] == epoch for i in s["indices"])
        assert seen == list(range(SAMPLES)), epoch
    assert {(s["at"], s["size"]) for s in steps if s["epoch"] == 0 and s["at"] in (20, 24, 30, 36)} == {
        (20, 2), (24, 3), (30, 3), (36, 2)}
    weight = next(r["weight"] for pid in first for r in by_pid[pid] if r["event"] == "done" and "weight" in r)
    np.testing.assert_allclose(weight, replay(steps), rtol=1e-5)
