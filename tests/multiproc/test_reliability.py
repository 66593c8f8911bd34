"""Faults injected into real 2-rank runs: NaN losses, ranks that disagree, a rank that dies."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from procs import check, free_port, loopback_env, run

from polytrain.checkpoint import read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).parent
CLI = [sys.executable, "-m", "polytrain.cli"]


def launch_local(tmp_path: Path, sets: list[str], **env: str):
    spec = tmp_path / "spec.yaml"
    spec.write_text("framework: torch\n")
    args = [a for s in sets for a in ("--set", s)]
    return run([*CLI, "launch", "--launcher", "local", "-np", "2", str(spec), "--quiet", *args],
               env=loopback_env(PYTHONPATH=str(HERE), **env))


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_loss_on_one_rank_is_seen_by_all(tmp_path: Path, policy: str) -> None:
    out = tmp_path / "out"
    result = launch_local(tmp_path, ["model.name=nan_model:make", "loop.epochs=2", f"output={out}",
                                     "optimizer.lr=0.1", "optimizer.momentum=0.9",
                                     f"reliability.on_nonfinite={policy}"], NAN_RANK="1", NAN_AT="5")
    if policy == "stop":
        assert result.returncode != 0
        lines = [line for line in result.stderr.splitlines() if "NaN/Inf" in line]
        assert len(lines) == 2, result.stderr  # both ranks stop, each with one line naming the step
        assert all(line.startswith("polytrain: error: step 5: the loss or a gradient is NaN/Inf") for line in lines)
        assert "Traceback" not in result.stderr
    else:
        check(result)
        events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "nonfinite"] == [5]
        state, manifest = read_model(out)
        assert len(set(manifest["rank_state_digests"])) == 1
        assert all(bool((abs(v) < 1e6).all()) for v in state.values())  # no NaN reached the weights
        assert manifest["val_accuracy"] > 0.5


def test_ranks_with_different_specs_fail_at_startup_on_every_rank(tmp_path: Path) -> None:
    """Two ranks started by hand (torchrun-style variables) with different learning rates."""
    import subprocess

    port = free_port()
    procs = []
    for rank, lr in ((0, "0.1"), (1, "0.2")):
        env = loopback_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                           MASTER_PORT=str(port))
        procs.append(subprocess.Popen([*CLI, "train", "--quiet", "--set", f"optimizer.lr={lr}", "--set",
                                       f"output={tmp_path}"], env=env, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    errors = []
    try:
        for proc in procs:
            errors.append(proc.communicate(timeout=120)[1])
    finally:
        for proc in procs:
            proc.kill()
    assert time.monotonic() - start < 120
    for proc, err in zip(procs, errors):
        assert proc.returncode == 1, err
        assert err.strip().splitlines()[-1].startswith("polytrain: error: startup check: rank 1's spec digest")


def test_a_dead_rank_fails_the_job_quickly_and_leaves_nothing(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed mid-step: the launcher names it, exits non-zero, and no worker is left."""
    start = time.monotonic()
    result = launch_local(tmp_path, ["model.name=faulty_model:make", "loop.epochs=2", f"output={tmp_path / 'o'}"],
                          FAULT_RANK="1", FAULT_AT="7")
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "polytrain launch: rank 1 was killed by SIGKILL; stopping the other 1 worker(s)" in result.stderr
    assert elapsed < 90
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _mentions(p, str(tmp_path))]
    assert leftovers == []


def _mentions(proc_dir: Path, text: str) -> bool:
    try:
        return text.encode() in (proc_dir / "cmdline").read_bytes()
    except OSError:
        return False
