"""``polytrain sweep`` (issue 30): a grid of runs of one spec as Ray Tune trials on a local Ray, with ASHA.

Four trials (two learning rates × two batch sizes; one learning rate makes the loss NaN at step 2, which stops
those runs): the sweep ends, the failed trials are reported as failed with their run's line, and the trial marked best — in the printed table and the CSV — is the one
whose own metrics.jsonl holds the highest val_accuracy among those that ran. A bad grid value is one line before
Ray starts.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from procs import loopback_env, read_metrics, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]
pytest.importorskip("ray.tune")

SPEC = {"framework": "torch", "backend": "local", "loop": {"epochs": 3},  # 2 by --set: the trials get the sets
        "data": {"name": "synthetic", "batch_size": 12, "val_fraction": 0.2,
                 "synthetic": {"samples": 200, "features": 6, "classes": 3, "noise": 1.5}}}


TOKEN_URI = "https://SECRET123@example.com/repo"  # a token as a URI's user-info (polytrain.observe.redact)


def sweep(tmp_path: Path, *flags: str):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**SPEC, "output": str(tmp_path / "out")}))
    return run([sys.executable, "-m", "polytrain.cli", "sweep", str(spec), *flags], timeout=240, env=loopback_env())


def test_a_four_trial_sweep_marks_the_best_and_reports_the_failed(tmp_path: Path) -> None:
    done = sweep(tmp_path, "--grid", "optimizer.lr=0.05,1.0e+30", "--grid", "data.batch_size=12,24",
                 "--metric", "val_accuracy", "--mode", "max", "--scheduler", "asha",
                 "--set", "loop.epochs=2", "--set", "logging.wandb.mode=disabled", "--set", f"logging.wandb.tags=[{TOKEN_URI}]")
    assert done.returncode == 0, done.stderr[-3000:]
    # a --set value holding a credential reaches the trials, yet no file of the sweep holds it (Tune's params.json)
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file() and b"SECRET123" in p.read_bytes()]
    assert "SECRET123" not in done.stdout + done.stderr
    rows = list(csv.DictReader((tmp_path / "out" / "sweep" / "sweep.csv").open()))
    assert sorted((r["optimizer.lr"], r["data.batch_size"]) for r in rows) == [
        ("0.05", "12"), ("0.05", "24"), ("1.0e+30", "12"), ("1.0e+30", "24")]
    diverged = [r for r in rows if r["optimizer.lr"] == "1.0e+30"]
    assert [r["status"] for r in diverged] == ["failed", "failed"]  # NaN at step 2: reliability.on_nonfinite stop
    ran = [r for r in rows if r["optimizer.lr"] == "0.05"]
    assert {r["status"] for r in ran} <= {"done", "stopped early"}
    own = {r["data.batch_size"]: max(e["val_accuracy"] for e in read_metrics(Path(r["output"]), "epoch"))
           for r in ran}
    assert {r["data.batch_size"]: float(r["val_accuracy"]) for r in ran} == own
    assert max(len(read_metrics(Path(r["output"]), "epoch")) for r in ran) == 2  # the sweep's --set reached them
    (best,) = [r for r in rows if r["best"] == "True"]
    assert float(best["val_accuracy"]) == max(own.values()) and best["optimizer.lr"] == "0.05"
    marked = [line for line in done.stdout.splitlines() if line.startswith("*")]
    assert len(marked) == 1 and marked[0].split()[1] == best["trial"]
    failed = [line for line in done.stdout.splitlines() if " failed: " in line]
    assert len(failed) == 2 and all("the loss or a gradient is NaN/Inf" in line for line in failed)


def test_a_bad_grid_value_is_one_line_before_ray_starts(tmp_path: Path) -> None:
    refused = sweep(tmp_path, "--grid", "optimizer.lr=0.1,fast")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "polytrain: error: --grid optimizer.lr=fast: optimizer.lr: expected a number, got 'fast'"]
