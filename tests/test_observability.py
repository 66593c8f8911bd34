"""What rank 0 writes: metrics.jsonl, metrics.csv, TensorBoard events with shared tags; `polytrain plot`."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.metrics import MetricsLog

CLI = [sys.executable, "-m", "polytrain.cli"]


def test_jsonl_csv_and_tensorboard_agree(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (10, 20):
        log.write("step", step=step, epoch=0, loss=1.0 / step, lr=0.1, samples_per_s=100.0 + step)
    log.write("epoch", epoch=0, step=20, train_loss=0.05, val_loss=0.07, val_accuracy=0.9)
    log.write("checkpoint", step=20, path="x")
    log.close()
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["step", "step", "epoch", "checkpoint"]
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["event"] for r in rows] == ["step", "step", "epoch"]
    assert float(rows[1]["loss"]) == pytest.approx(0.05) and float(rows[2]["val_accuracy"]) == 0.9
    tf = pytest.importorskip("tensorflow")
    (event_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    scalars = {}
    for record in tf.compat.v1.train.summary_iterator(str(event_file)):
        for value in record.summary.value:
            scalars[(value.tag, record.step)] = value.simple_value
    assert scalars[("train/loss", 20)] == pytest.approx(0.05)
    assert scalars[("val/accuracy", 20)] == pytest.approx(0.9)
    assert scalars[("train/samples_per_s", 10)] == pytest.approx(110.0)


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    log = MetricsLog(None)
    log.write("step", step=1, loss=1.0)
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_plot_two_runs(tmp_path: Path) -> None:
    for name, scale in (("ddp", 1.0), ("tf", 1.2)):
        log = MetricsLog(tmp_path / name / "metrics.jsonl", tensorboard=False)
        for step in range(1, 6):
            log.write("step", step=step * 10, epoch=step - 1, loss=scale / step, lr=0.1, samples_per_s=500.0)
            log.write("epoch", epoch=step - 1, step=step * 10, train_loss=scale / step, val_loss=1.0,
                      val_accuracy=0.5 + step / 20)
        log.close()
    out = tmp_path / "plot.png"
    proc = subprocess.run([*CLI, "plot", tmp_path / "ddp", tmp_path / "tf", "-o", out], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 2 * height  # three panels side by side


def test_plot_of_a_directory_without_metrics_is_a_one_line_error(tmp_path: Path) -> None:
    proc = subprocess.run([*CLI, "plot", tmp_path, "-o", tmp_path / "x.png"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"polytrain: error: plot: {tmp_path} has no metrics.jsonl (give the output " \
                                  f"directory of a run)"
