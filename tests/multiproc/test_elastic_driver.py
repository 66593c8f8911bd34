"""polytrain's elastic driver with real processes: ``polytrain launch --launcher horovodrun`` and horovodrun's
elastic flags, ``POLYTRAIN_HOROVOD_IMPL=shim``, ``localhost`` and ``127.0.0.1`` as two hosts (as Horovod's
tests). The worker (elastic_worker.py) uses only `membership`, `reform` and raw torch.distributed: an allreduce
loop whose committed total is the sum of the group sizes of the steps it ran, so a step lost or run twice
shows in the number. A killed worker is a real SIGKILL (it kills itself after a given committed step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from procs import loopback_env, run

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = str(Path(__file__).resolve().parent / "elastic_worker.py")
LAUNCH = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "horovodrun"]


def elastic(tmp_path: Path, flags: list[str], steps: int, until_size: int = 0, **env: str):
    logs = tmp_path / "logs"
    logs.mkdir()
    result = run([*LAUNCH, *flags, WORKER, str(logs), str(steps), str(until_size)], timeout=240,
                 env=loopback_env(POLYTRAIN_HOROVOD_IMPL="shim", POLYTRAIN_ELASTIC_DISCOVERY_INTERVAL="0.1",
                                  HOROVOD_GLOO_TIMEOUT_SECONDS="60", **env))
    assert result.left_behind == [], result.left_behind
    records = [json.loads(line) for path in sorted(logs.glob("*.jsonl")) for line in path.read_text().splitlines()]
    return result, records


def driver_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("polytrain elastic:")]


def test_sigkilled_worker_survivors_reform_in_place_and_finish(tmp_path):
    result, records = elastic(tmp_path, ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1"], 12,
                              ELASTIC_TEST_KILL_RANK="2", ELASTIC_TEST_KILL_STEP="4")
    assert result.returncode == 0, result.stderr
    formed = {(r["pid"], r["version"]): r for r in records if r["event"] == "formed"}
    done = {r["pid"]: r for r in records if r["event"] == "done"}
    first = {r["pid"] for r in formed.values() if r["version"] == 0}
    second = {r["pid"] for r in formed.values() if r["version"] == 1}
    assert len(first) == 3 and len(second) == 2 and second < first  # the survivors, same processes
    assert sorted(formed[(pid, 1)]["rank"] for pid in second) == [0, 1]
    assert {formed[(pid, 1)]["size"] for pid in second} == {2}
    assert {formed[(pid, 1)]["step"] for pid in second} == {4}  # carried on from the last commit
    assert set(done) == second
    # 4 steps at size 3, then 8 at size 2: nothing lost, nothing done twice
    assert {(r["step"], r["total"]) for r in done.values()} == {(12, 4 * 3 + 8 * 2)}
    assert any("blacklisted host 127.0.0.1" in line and "code 137" in line for line in driver_lines(result))


def test_host_added_by_discovery_joins_at_the_next_round(tmp_path):
    mark = tmp_path / "grow"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho localhost:1\nif [ -f {mark} ]; then echo 127.0.0.1:1; fi\n")
    script.chmod(0o755)
    result, records = elastic(tmp_path, ["-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                                         str(script)], 6, until_size=2, ELASTIC_TEST_MARK=str(mark),
                              ELASTIC_TEST_KILL_STEP="3")
    assert result.returncode == 0, result.stderr
    formed = [r for r in records if r["event"] == "formed"]
    old = [r for r in formed if r["spawn_rank"] == 0]
    new = [r for r in formed if r["spawn_rank"] == 1]
    assert (old[0]["version"], old[0]["size"], old[-1]["size"]) == (0, 1, 2) and len({r["pid"] for r in old}) == 1
    assert [(r["size"], r["rank"]) for r in new] == [(2, 1)] and new[0]["version"] >= 1  # joined the next round
    joined = new[0]["step"]
    assert joined >= 3 and new[0]["total"] == joined  # the newcomer got the survivors' state
    done = [r for r in records if r["event"] == "done"]
    assert len(done) == 2 and {(r["step"], r["total"]) for r in done} == {
        (done[0]["step"], joined + 2 * (done[0]["step"] - joined))}


def test_reset_limit(tmp_path):
    result, _ = elastic(tmp_path, ["-np", "2", "--min-np", "1", "--reset-limit", "0", "-H", "localhost:1,127.0.0.1:1"],
                        50, ELASTIC_TEST_KILL_RANK="1", ELASTIC_TEST_KILL_STEP="2")
    assert result.returncode == 1
    assert driver_lines(result)[-1] == (
        "polytrain elastic: reset limit 0 exceeded (Horovod was shutdown because number of resets during elastic "
        "job exceeded limit: 0)")


def test_min_np_not_met_names_the_host_lost_and_why(tmp_path):
    result, _ = elastic(tmp_path, ["-np", "2", "--min-np", "2", "--elastic-timeout", "1",
                                   "-H", "localhost:1,127.0.0.1:1"], 50,
                        ELASTIC_TEST_KILL_RANK="1", ELASTIC_TEST_KILL_STEP="2")
    assert result.returncode == 1
    assert driver_lines(result)[-1] == (
        "polytrain elastic: min-np 2 not met within --elastic-timeout 1 s: 1 slots available; lost 127.0.0.1 "
        "(blacklisted: 127.0.0.1[0] (rank 1) exit code 137)")


def test_all_workers_failed(tmp_path):
    result, _ = elastic(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"], 50,
                        ELASTIC_TEST_FAIL_RANKS="0,1", ELASTIC_TEST_KILL_STEP="2")
    assert result.returncode == 1
    last = driver_lines(result)[-1]
    assert last.startswith("polytrain elastic: every worker failed; the first: ") and last.endswith("exit code 3")
