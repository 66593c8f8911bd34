"""What rank 0 writes: metrics.jsonl, metrics.csv, TensorBoard events with shared tags; `polytrain plot`."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.observe.metrics import MetricsLog

CLI = [sys.executable, "-m", "polytrain.cli"]


def test_jsonl_csv_and_tensorboard_agree(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (10, 20):
        log.write("step", step=step, epoch=0, loss=1.0 / step, lr=0.1, samples_per_s=100.0 + step)
    log.write("epoch", epoch=0, step=20, train_loss=0.05, val_loss=0.07, val_accuracy=0.9, val_top5_accuracy=0.99,
              val_f1=0.8)
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
    assert scalars[("val/top5_accuracy", 20)] == pytest.approx(0.99) and scalars[("val/f1", 20)] == pytest.approx(0.8)
    assert scalars[("train/samples_per_s", 10)] == pytest.approx(110.0)


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    log = MetricsLog(None)
    log.write("step", step=1, loss=1.0)
    log.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
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


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_without_a_terminal_prints_throttled_lines_with_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from polytrain.observe import metrics as metrics

    clock = _Clock()
    monkeypatch.setattr(metrics.time, "monotonic", clock)
    stream = io.StringIO()
    progress = metrics.Progress(enabled=True, stream=stream, interval_s=10)
    progress.start_epoch(0, 2, total=100)
    for done in range(1, 101):  # one step per second
        clock.now += 1.0
        progress.update(done, 0.5, 64.0)
    progress.end_epoch()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10  # every 10 s, and the epoch's last step
    assert lines[0] == "epoch 1/2 step 10/100 loss 0.5000 64 samples/s ETA 1m30s"
    assert lines[-1] == "epoch 1/2 step 100/100 loss 0.5000 64 samples/s"


def test_progress_of_another_rank_is_prefixed_and_never_a_bar() -> None:
    import io

    from polytrain.observe.metrics import Progress

    stream = io.StringIO()
    stream.isatty = lambda: True  # type: ignore[method-assign]
    progress = Progress(enabled=True, stream=stream, prefix="[rank 1] ", interval_s=0)
    progress.start_epoch(0, 1, total=2)
    progress.update(2, 0.25, 10.0)
    assert progress.bar is None
    assert stream.getvalue() == "[rank 1] epoch 1/1 step 2/2 loss 0.2500 10 samples/s\n"


def test_read_records_follows_a_log_that_is_still_being_written(tmp_path: Path) -> None:
    """A sweep trial reads its run's metrics.jsonl while the run writes it: each call returns the records added
    since the last, and a line not yet whole waits for the next call; a line a crash cut short is skipped."""
    from polytrain.observe.metrics import read_records

    path = tmp_path / "metrics.jsonl"
    assert read_records(path) == ([], 0)
    path.write_text('{"event": "step", "step": 1}\n{"cut short\n{"event": "epoch", "st')
    first, offset = read_records(path)
    assert first == [{"event": "step", "step": 1}]
    with path.open("a") as file:
        file.write('ep": 2}\n')
    assert read_records(path, offset) == ([{"event": "epoch", "step": 2}], path.stat().st_size)
    assert read_records(path)[0] == [{"event": "step", "step": 1}, {"event": "epoch", "step": 2}]


def test_tensorboard_events_are_written_in_the_callers_thread_and_flushed_by_time(tmp_path: Path) -> None:
    """No writer threads (tensorboardX's SummaryWriter wakes two on every scalar, competing with the training
    step); the first record reaches the file at once, later ones at most ``flush_s`` after they were written, and
    all of them at close."""
    import threading

    tf = pytest.importorskip("tensorflow")
    threads = set(threading.enumerate())
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write("step", step=10, epoch=0, loss=0.5, lr=0.1, samples_per_s=100.0)
    assert set(threading.enumerate()) == threads
    log._tb.flush_s = 3600.0

    def logged() -> dict[tuple[str, int], float]:
        (event_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
        return {(value.tag, record.step): value.simple_value
                for record in tf.compat.v1.train.summary_iterator(str(event_file)) for value in record.summary.value}

    assert logged()[("train/loss", 10)] == 0.5  # the first record at once
    log.write("step", step=20, epoch=0, loss=0.25, lr=0.1, samples_per_s=100.0)
    assert ("train/loss", 20) not in logged()  # buffered
    log.write("epoch", epoch=0, step=20, train_loss=0.3, val_loss=0.4, val_accuracy=0.9)
    assert ("val/accuracy", 20) not in logged()
    log._tb.flush_s = 0.0
    log.write("step", step=30, epoch=1, loss=0.125, lr=0.1, samples_per_s=100.0)
    assert logged()[("train/loss", 20)] == 0.25 and logged()[("val/accuracy", 20)] == pytest.approx(0.9)
    assert logged()[("train/loss", 30)] == 0.125
    log._tb.flush_s = 3600.0
    log.write("step", step=40, epoch=1, loss=0.0625, lr=0.1, samples_per_s=100.0)
    log.close()
    assert logged()[("train/loss", 40)] == 0.0625


def test_event_records_are_framed_with_castagnoli_crcs_and_need_no_torch(tmp_path: Path) -> None:
    """The CRC is CRC-32C (its check value), and writing events imports no framework: a TensorFlow rank would
    otherwise pay PyTorch's import (tensorboardX's package imports it) for a log file."""
    from polytrain.observe import tfevents

    assert tfevents.crc32c(b"123456789") == 0xE3069283
    assert tfevents._varint(-1) == b"\xff" * 9 + b"\x01" and tfevents._varint(300) == b"\xac\x02"
    code = ("import sys; from pathlib import Path; from polytrain.observe.metrics import MetricsLog; "
            f"log = MetricsLog(Path({str(tmp_path / 'metrics.jsonl')!r})); log.write('step', step=1, loss=0.5); "
            "log.close(); print(sorted({'torch', 'tensorflow', 'tensorboardX'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
