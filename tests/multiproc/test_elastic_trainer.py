"""The Trainer keeps training in place when a rank is SIGKILLed (issue 51.5, on ddp, on horovod with polytrain's
Horovod implementation and on fsdp, whose re-form shards the committed whole state again): a 3-rank job under
``polytrain launch --launcher local --elastic`` loses spawn rank 1 at the end of step 5; its two peers roll back
to their commit of step 4 (``commit_every_n_steps: 2``), re-form the group at 2 ranks in the same processes and
finish the epoch with the same global batch. Compared with a run that goes from 3 to 2 ranks at that commit with
no failure (3 ranks to step 4 with a checkpoint there, then resumed on 2 ranks): the same samples, each once,
and the same final weights (rtol 1e-5)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from multiproc.elastic_parts import last_trained as _trained
from procs import check, loopback_env, run, train
from safetensors.numpy import load_file

HERE = Path(__file__).resolve().parent
KILL_STEP, KILL_RANK, GLOBAL_BATCH = 5, 1, 96
# each rank on a loopback "host" of its own: the driver blacklists the dead rank's host only (Horovod's rule)
HOSTS = "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"


def _spec(tmp_path: Path, out: Path, elastic: bool, backend: str = "ddp", min_np: int = 2) -> Path:
    spec = {"framework": "torch", "backend": backend, "model": {"name": "elastic_parts:model"},
            "data": {"name": "digits", "global_batch_size": GLOBAL_BATCH}, "loop": {"epochs": 1},
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "callbacks": ["elastic_parts:Samples"],
            "output": str(out), "reliability": {"collective_timeout_s": 60}}
    if elastic:
        spec["elastic"] = {"min_np": min_np, "max_np": 3, "commit_every_n_steps": 2}
    path = tmp_path / f"{out.name}{'-elastic' if elastic else ''}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job with no failure, going from 3 to 2 ranks at the commit: a checkpoint of step 4 on 3 ddp ranks,
    resumed on 2 (each backend trains like ddp: the same average of the same gradients)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    ref = tmp_path / "reference"
    spec = _spec(tmp_path, ref, False)
    ref_env = {"PYTHONPATH": str(HERE)}
    check(train(ref, [f"loop.max_steps={KILL_STEP - 1}", f"checkpoint.every_n_steps={KILL_STEP - 1}"], spec=spec,
                nproc=3, env=ref_env, timeout=300))
    check(train(ref, [], spec=spec, nproc=2, resume="auto", env=ref_env, timeout=300))
    return ref


def _env() -> dict[str, str]:
    return loopback_env(PYTHONPATH=str(HERE), ELASTIC_TEST_KILL=f"{KILL_STEP}:{KILL_RANK}",
                        POLYTRAIN_ELASTIC_DISCOVERY_INTERVAL="0.2", HOROVOD_GLOO_TIMEOUT_SECONDS="60",
                        POLYTRAIN_HOROVOD_IMPL="shim")


def _same_weights(out: Path, ref: Path) -> None:
    mine, theirs = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["ddp", "horovod", "fsdp"])
def test_a_killed_rank_costs_no_work(tmp_path: Path, reference: Path, backend: str) -> None:
    env = _env()
    out = tmp_path / "elastic"
    result = run([*__import__("procs").PYTHON, "-m", "polytrain.cli", "launch", "--launcher", "local", "--elastic",
                  "-np", "3", "--min-np", "2", "-H", HOSTS, str(_spec(tmp_path, out, True, backend))], env=env,
                 timeout=400)
    check(result)
    assert result.left_behind == []
    records = _records(out)
    pids = {r["rank"]: r["pid"] for r in records if r["round"] == 0}
    assert len(pids) == 3
    after = {r["pid"] for r in records if r["round"] == 1}
    # the survivors went on in the processes they were: no process was started for them
    assert after == {pids[0], pids[2]}, (pids, after)
    assert all(r["size"] == 2 for r in records if r["round"] == 1)
    final = _trained(records)
    steps = sorted(final)
    assert steps == list(range(1, len(steps) + 1))
    redone = sorted({r["step"] for r in records if r["round"] == 1} & {r["step"] for r in records if r["round"] == 0})
    assert redone == [KILL_STEP]  # rolled back to the commit of step 4: only step 5 is trained again
    assert [len(final[s]) for s in steps] == [3] * (KILL_STEP - 1) + [2] * (len(steps) - KILL_STEP + 1)
    elastic_rows = Counter(row for s in steps for r in final[s] for row in r["rows"])

    ref = reference
    ref_final = _trained(_records(ref))
    assert sorted(ref_final) == steps
    ref_rows = Counter(row for s in steps for r in ref_final[s] for row in r["rows"])
    # every sample of the epoch trained exactly once: the same samples, as often, as the run that never failed
    assert elastic_rows == ref_rows
    assert sum(elastic_rows.values()) == sum(len(r["rows"]) for s in steps for r in ref_final[s])
    assert sum(elastic_rows.values()) >= GLOBAL_BATCH * (len(steps) - 1)
    _same_weights(out, ref)


@pytest.mark.timeout(600)
def test_too_few_ranks_leave_the_last_commit_as_a_checkpoint(tmp_path: Path, reference: Path) -> None:
    """``min_np: 3``: after the kill the driver finds 2 slots, waits ``--elastic-timeout`` for a third, then forms a
    final round of the 2 survivors, which write their commit of step 4 as a checkpoint and end the job in one line
    naming it. Resumed on 2 ranks, it ends on the weights of the run that went from 3 to 2 ranks at step 4."""
    out = tmp_path / "elastic"
    result = run([*__import__("procs").PYTHON, "-m", "polytrain.cli", "launch", "--launcher", "local", "--elastic",
                  "-np", "3", "--elastic-timeout", "2", "-H", HOSTS, str(_spec(tmp_path, out, True, min_np=3))],
                 env=_env(), timeout=400)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.left_behind == []
    assert "polytrain elastic: min-np 3 not met within --elastic-timeout 2 s: 2 slots available" in result.stderr
    saved = out / "checkpoints" / "step-00000004"
    assert f"the last commit (step {KILL_STEP - 1}) is saved as {saved}" in result.stderr, result.stderr[-3000:]
    assert json.loads((saved / "manifest.json").read_text())["world_size"] == 2
    check(train(out, [], spec=_spec(tmp_path, out, False), nproc=2, resume="auto", env={"PYTHONPATH": str(HERE)},
                timeout=300))
    _same_weights(out, reference)


@pytest.mark.timeout(600)
def test_a_second_rank_lost_right_after_a_recovery(tmp_path: Path, reference: Path) -> None:
    """Spawn rank 1 dies at the end of step 5, spawn rank 2 as soon as the re-formed group starts training
    (``min_np: 1``): rank 0's first collective at 2 ranks fails too, it rolls back to the same commit of step 4
    again and trains the rest alone, in its own process. The same samples once each, and the weights of the 3-rank
    checkpoint of step 4 resumed on one rank."""
    out = tmp_path / "elastic"
    result = run([*__import__("procs").PYTHON, "-m", "polytrain.cli", "launch", "--launcher", "local", "--elastic",
                  "-np", "3", "-H", HOSTS, str(_spec(tmp_path, out, True, min_np=1))],
                 env={**_env(), "ELASTIC_TEST_KILL_AT_START": f"1:{KILL_RANK + 1}"}, timeout=400)
    check(result)
    assert result.left_behind == []
    records = _records(out)
    pids = {r["rank"]: r["pid"] for r in records if r["round"] == 0}
    assert {r["round"] for r in records} == {0, 2}  # round 1 trained no step: its peer died at its start
    assert {(r["pid"], r["size"]) for r in records if r["round"] == 2} == {(pids[0], 1)}
    final = _trained(records)
    steps = sorted(final)
    assert [len(final[s]) for s in steps] == [3] * (KILL_STEP - 1) + [1] * (len(steps) - KILL_STEP + 1)

    one = tmp_path / "one"  # the reference's checkpoint of step 4, resumed on one rank
    check(train(one, [], spec=_spec(tmp_path, one, False), nproc=1, env={"PYTHONPATH": str(HERE)}, timeout=300,
                resume=reference / "checkpoints" / f"step-{KILL_STEP - 1:08d}"))
    ref = {**{s: r for s, r in _trained(_records(reference)).items() if s < KILL_STEP}, **_trained(_records(one))}
    assert sorted(ref) == steps
    rows = [Counter(row for s in steps for r in trained[s] for row in r["rows"]) for trained in (final, ref)]
    assert rows[0] == rows[1]  # every sample of the epoch once, as in the run that never failed
    _same_weights(out, one)
