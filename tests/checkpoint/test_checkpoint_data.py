"""A checkpoint records what its data was; a resume onto changed data is refused in one line, or, with
``--accept-changed-data``, starts the checkpoint's epoch over (issue 26, item 2).

The scenario of the issue: a CSV of 100 rows (80 train, 20 validation; 10 a step, 8 steps an epoch),
stopped at step 12 (epoch 2, step 4), then shrunk to 50 rows or grown by one row. Before, the first ran
0 steps of later epochs and the second repeated and skipped samples, both exiting 0.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import read_metrics, run
from trainer_fakes import FakeJob
from trainer_runs import BASE, _merge, fit, fit_fails, records

from polytrain.checkpoint import manifest as cm
from polytrain.checkpoint import store as ckpt
from polytrain.checkpoint.fingerprint import LISTED, WHOLE, changes, fingerprint
from polytrain.data.live import data_from_objects
from polytrain.data.source import Data
from polytrain.registry import open_data
from polytrain.spec.tables import DataSpec, TrainSpec
from polytrain.train.trainer import Trainer
from polytrain.validation import from_dict

CSV_DATA = {"name": "csv", "features": ["a", "b"], "label": "label", "batch_size": 10, "val_fraction": 0.2}


def write_csv(path: Path, rows: int, start: int = 0) -> None:
    """``rows`` rows whose features name the row (a = row number): a sample is known by its x."""
    lines = [] if start else ["a,b,label"]
    lines += [f"{i},{i % 7},{i % 2}" for i in range(start, start + rows)]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def csv_spec(tmp_path: Path, **changes: Any) -> TrainSpec:
    """trainer_runs' spec with the CSV in place of its synthetic data."""
    base = {k: v for k, v in BASE.items() if k != "data"}
    return from_dict(_merge(base, {"output": str(tmp_path / "out"),
                                   "data": {**CSV_DATA, "path": str(tmp_path / "d.csv")}, **changes}))


def stopped_mid_epoch(tmp_path: Path) -> TrainSpec:
    """The issue's run: 100 rows, 3 epochs of 8 steps, stopped at step 12 with a checkpoint there."""
    write_csv(tmp_path / "d.csv", 100)
    fit(csv_spec(tmp_path, loop={"epochs": 3, "max_steps": 12}, checkpoint={"every_n_steps": 4}))
    spec = csv_spec(tmp_path, loop={"epochs": 3}, checkpoint={"every_n_steps": 4})
    saved = json.loads((spec.checkpoint_dir / "step-00000012" / "manifest.json").read_text())
    assert (saved["epoch"], saved["step_in_epoch"]) == (1, 4)
    assert (saved["dataset"]["train"], saved["dataset"]["val"]) == (80, 20)
    return spec


def shrink(path: Path, rows: int) -> None:
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:rows + 1]))


# ---------------------------------------------------------------------------- through the Trainer


def test_a_shrunk_csv_is_refused_in_one_line_before_anything_is_loaded(tmp_path: Path) -> None:
    spec = stopped_mid_epoch(tmp_path)
    shrink(tmp_path / "d.csv", 50)
    error, job = fit_fails(spec, ckpt.CheckpointError, resume="auto")
    message = str(error)
    assert "\n" not in message and message.startswith("--resume: the data changed since ")
    assert f"data.path: {tmp_path / 'd.csv'} is " in message
    assert "training samples 80 → 40, validation samples 20 → 10" in message
    assert "--accept-changed-data to start epoch 2 over" in message
    assert job.fw.calls.loaded == 0 and job.fw.calls.micro == []


def test_accepted_changed_data_starts_the_epoch_over_and_trains_every_remaining_epoch(tmp_path: Path) -> None:
    spec = stopped_mid_epoch(tmp_path)
    shrink(tmp_path / "d.csv", 50)  # 40 training samples: 4 steps an epoch
    job = FakeJob()
    trainer_result = Trainer(spec, show_progress=False, resume="auto", accept_changed_data=True,
                             backend_factory=job.backend_factory, framework_factory=job.framework_factory).fit()
    steps = sorted({m.step for m in job.fw.calls.micro})
    assert steps == list(range(13, 21))  # epochs 2 and 3 in full on the new data, the global step going on
    assert trainer_result.global_step == 20 and trainer_result.epochs_done == 3
    data = open_data(spec)
    train_x = {float(x) for x in data.train.read(np.arange(len(data.train)))[0][:, 0]}
    for epoch_steps in (range(13, 17), range(17, 21)):  # each epoch: every training sample exactly once
        seen = [float(row[0]) for m in job.fw.calls.micro if m.step in epoch_steps for row in m.x]
        assert sorted(seen) == sorted(train_x)
    [changed] = records(spec, "data_changed")
    assert (changed["step"], changed["epoch"]) == (12, 1) and "training samples 80 → 40" in changed["changes"]
    assert [r["step"] for r in records(spec, "resume")] == [12]


def test_one_appended_row_is_refused(tmp_path: Path) -> None:
    spec = stopped_mid_epoch(tmp_path)
    write_csv(tmp_path / "d.csv", 1, start=100)
    error, _ = fit_fails(spec, ckpt.CheckpointError, resume="auto")
    assert "training samples 80 → 81, validation samples 20 → 20" in str(error)


def test_the_same_data_resumes_mid_epoch(tmp_path: Path) -> None:
    spec = stopped_mid_epoch(tmp_path)
    _, job = fit(spec, resume="auto")
    assert min(m.step for m in job.fw.calls.micro) == 13 and records(spec, "data_changed") == []


def test_a_same_size_edit_with_a_new_modification_time_is_a_change(tmp_path: Path) -> None:
    """A label changed in place (the same size, a new time): the contents differ, so it is a change (issue 48, item
    17 keeps this refusal; a new time alone no longer is one, below)."""
    spec = stopped_mid_epoch(tmp_path)
    text = (tmp_path / "d.csv").read_text()
    (tmp_path / "d.csv").write_text(text.replace("\n5,5,1\n", "\n5,5,0\n"))
    os.utime(tmp_path / "d.csv", ns=(0, 10**18))
    error, _ = fit_fails(spec, ckpt.CheckpointError, resume="auto")
    assert "was modified since (same size" in str(error) and "the same counts (80 training" in str(error)


def copied_without_times(path: Path) -> None:
    """``path`` replaced by a byte-identical copy with a new modification time (and inode), as ``cp`` without
    ``-p`` to node-local storage leaves it."""
    before = path.stat().st_mtime_ns
    shutil.copyfile(path, path.with_name(path.name + ".copy"))
    os.replace(path.with_name(path.name + ".copy"), path)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_byte_identical_data_with_a_new_time_resumes_mid_epoch(tmp_path: Path) -> None:
    """Issue 48, item 17: before, "was modified since (same size ...)" refused it."""
    spec = stopped_mid_epoch(tmp_path)
    copied_without_times(tmp_path / "d.csv")
    _, job = fit(spec, resume="auto")
    assert min(m.step for m in job.fw.calls.micro) == 13 and max(m.step for m in job.fw.calls.micro) == 24
    assert records(spec, "data_changed") == []


def test_a_checkpoint_without_a_data_record_still_resumes_where_it_stood(tmp_path: Path) -> None:
    """Manifests written before this change have no ``dataset``: they resume at their position, unchecked."""
    spec = stopped_mid_epoch(tmp_path)
    path = spec.checkpoint_dir / "step-00000012" / "manifest.json"
    saved = json.loads(path.read_text())
    del saved["dataset"], saved[cm.DIGEST_KEY]  # nor a digest of their own (polytrain.checkpoint.manifest)
    path.write_text(json.dumps(saved))
    _, job = fit(spec, resume="auto")
    assert min(m.step for m in job.fw.calls.micro) == 13 and max(m.step for m in job.fw.calls.micro) == 24


# ---------------------------------------------------------------------------- the fingerprint of each source


def opened(model: str = "mlp", **fields: Any) -> tuple[DataSpec, Data]:
    """A spec's data fields and its data, opened as the Trainer opens them."""
    spec = from_dict({"data": fields, "model": {"name": model}})
    return spec.data, open_data(spec)


def recorded(model: str = "mlp", **fields: Any) -> dict[str, Any]:
    return fingerprint(*opened(model, **fields))


def test_csv_files_are_recorded_with_size_and_time(tmp_path: Path) -> None:
    write_csv(tmp_path / "d.csv", 30)
    before = recorded(**CSV_DATA, path=str(tmp_path / "d.csv"))
    [entry] = before["files"]["path"]["listed"]
    stat = (tmp_path / "d.csv").stat()
    assert entry == {"file": str(tmp_path / "d.csv"), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    assert (before["train"], before["val"]) == (24, 6) and before["samples"] == {}
    assert changes(before, recorded(**CSV_DATA, path=str(tmp_path / "d.csv"))) is None
    write_csv(tmp_path / "e.csv", 10)
    assert changes(before, recorded(**CSV_DATA, path=str(tmp_path))) == (
        f"data.path: 1 → 2 files (new {tmp_path / 'e.csv'}); training samples 24 → 32, validation samples 6 → 8")


def test_parquet_row_groups_are_recorded(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"a": np.arange(40, dtype=np.float32), "label": np.arange(40) % 2})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=10)
    fields = {"name": "parquet", "path": str(tmp_path / "t.parquet"), "features": ["a"], "label": "label"}
    before = recorded(**fields)
    assert before["files"]["path"]["listed"][0]["row_groups"] == 4
    mtime = (tmp_path / "t.parquet").stat().st_mtime_ns
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=20)
    os.utime(tmp_path / "t.parquet", ns=(mtime, mtime))
    assert changes(before, recorded(**fields)) == (
        f"data.path: {tmp_path / 't.parquet'} has 2 row groups, was 4; the same counts (32 training, 8 validation "
        "samples)")


def test_images_token_files_and_npz_are_recorded(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    for cls in ("a", "b"):
        (tmp_path / "img" / cls).mkdir(parents=True)
        for i in range(3):
            image.new("L", (4, 4), color=i).save(tmp_path / "img" / cls / f"{i}.png")
    listed = recorded(name="images", path=str(tmp_path / "img"), channels=1, val_fraction=0.5)["files"]["path"]["listed"]
    assert sorted(Path(e["file"]).relative_to(tmp_path / "img").as_posix() for e in listed) == [
        "a/0.png", "a/1.png", "a/2.png", "b/0.png", "b/1.png", "b/2.png"]
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    tokens = recorded("transformer", name="token_file", path=str(tmp_path / "tokens.bin"), seq_len=8)
    assert tokens["files"]["path"]["listed"][0]["bytes"] == 400
    np.savez(tmp_path / "d.npz", x=np.arange(20, dtype=np.float32).reshape(10, 2), y=np.arange(10) % 2)
    arrays = recorded(name="npz", path=str(tmp_path / "d.npz"))
    assert arrays["files"]["path"]["files"] == 1 and set(arrays["samples"]) == {"train", "val"}


def test_many_files_are_recorded_as_a_count_and_a_digest(tmp_path: Path) -> None:
    for i in range(LISTED + 1):
        (tmp_path / f"{i:04d}.csv").write_text(f"a,b,label\n{i},0,{i % 2}\n")
    before = recorded(**CSV_DATA, path=str(tmp_path))
    assert "listed" not in before["files"]["path"] and before["files"]["path"]["files"] == LISTED + 1
    (tmp_path / "9999.csv").write_text("a,b,label\n9,9,1\n")
    assert changes(before, recorded(**CSV_DATA, path=str(tmp_path))).startswith(
        f"data.path: {LISTED + 1} → {LISTED + 2} files; training samples")


def test_a_copy_with_new_times_is_the_same_data_for_large_files_parquet_and_many_files(tmp_path: Path) -> None:
    """Contents are compared only where the size (and row groups) match and the time differs: a large file by
    sampled blocks (and Parquet's footer), more than LISTED files by one digest of evenly chosen files' contents."""
    tokens = tmp_path / "tokens.bin"
    np.arange(WHOLE, dtype=np.uint16).tofile(tokens)  # 2 x WHOLE bytes: sampled, not read whole
    fields = {"name": "token_file", "path": str(tokens), "seq_len": 8}
    before = recorded("transformer", **fields)
    copied_without_times(tokens)
    assert changes(before, recorded("transformer", **fields)) is None
    original = tokens.read_bytes()
    data = bytearray(original)
    data[1] ^= 0xFF  # the first block is always read
    tokens.write_bytes(bytes(data))
    os.utime(tokens, ns=(1, 10**18))
    assert changes(before, recorded("transformer", **fields)) == (
        f"data.path: {tokens} was modified since (same size, {2 * WHOLE:,} bytes); the same counts "
        f"({before['train']} training, {before['val']} validation samples)")
    tokens.write_bytes(original)  # the same bytes again, another time: the same data
    assert changes(before, now := recorded("transformer", **fields)) is None
    legacy = json.loads(json.dumps(before))
    del legacy["files"]["path"]["contents"]  # a checkpoint from before contents were recorded: a new time is a change
    assert "was modified since (same size" in changes(legacy, now)

    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = np.random.default_rng(0).random((WHOLE // 4, 2), dtype=np.float32)
    pq.write_table(pa.table({"a": rows[:, 0], "b": rows[:, 1], "label": np.arange(len(rows)) % 2}),
                   tmp_path / "t.parquet", row_group_size=len(rows) // 4)
    assert (tmp_path / "t.parquet").stat().st_size > WHOLE
    fields = {"name": "parquet", "path": str(tmp_path / "t.parquet"), "features": ["a", "b"], "label": "label"}
    before = recorded(**fields)
    copied_without_times(tmp_path / "t.parquet")
    assert changes(before, recorded(**fields)) is None

    many = tmp_path / "many"
    many.mkdir()
    for i in range(LISTED + 1):
        (many / f"{i:04d}.csv").write_text(f"a,b,label\n{i},0,{i % 2}\n")
    before = recorded(**CSV_DATA, path=str(many))
    for file in sorted(many.iterdir()):
        copied_without_times(file)
    assert changes(before, recorded(**CSV_DATA, path=str(many))) is None
    (many / "0000.csv").write_text("a,b,label\n0,0,1\n")  # the first file is always among those read
    assert changes(before, recorded(**CSV_DATA, path=str(many))).startswith(
        "data.path: a file was modified since (same names and sizes)")


def test_in_memory_arrays_are_recorded_by_a_few_samples_user_datasets_by_their_counts() -> None:
    spec = from_dict({}).data
    x, y = np.arange(60, dtype=np.float32).reshape(30, 2), np.arange(30) % 2
    before = fingerprint(spec, data_from_objects((x, y), None, spec, 0))
    x[0, 0] = -1.0  # the first sample is always among those read
    assert changes(before, fingerprint(spec, data_from_objects((x, y), None, spec, 0))).startswith(
        "the in-memory samples differ; the same counts (24 training, 6 validation samples)")

    class Items:
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
            return np.random.default_rng().random(2).astype(np.float32), i % 2  # random: never read for this

    items = fingerprint(spec, data_from_objects(Items(30), None, spec, 0))
    assert items["samples"] == {} and items["files"] == {}
    assert changes(items, fingerprint(spec, data_from_objects(Items(30), None, spec, 0))) is None
    assert changes(items, fingerprint(spec, data_from_objects(Items(35), None, spec, 0))) == (
        "training samples 24 → 28, validation samples 6 → 7")


# ---------------------------------------------------------------------------- the runs, through the CLI


SPEC = """
framework: torch
backend: local
model: {name: mlp, params: {hidden_sizes: [4]}}
data: {name: csv, path: d.csv, features: [a, b], label: label, batch_size: 10, val_fraction: 0.2}
loop: {epochs: 3, log_every_n_steps: 1}
checkpoint: {every_n_steps: 4}
output: out
"""


def cli(tmp_path: Path, *args: str) -> Any:
    return run([sys.executable, "-m", "polytrain.cli", "train", "spec.yaml", "--quiet", *args], cwd=tmp_path,
               timeout=300)


@pytest.mark.parametrize("change", ["shrink", "append"])
@pytest.mark.slow
def test_the_cli_refuses_changed_data_and_accepts_it_when_told(tmp_path: Path, change: str) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC)
    write_csv(tmp_path / "d.csv", 100)
    assert cli(tmp_path, "--set", "loop.max_steps=12").returncode == 0
    if change == "shrink":
        shrink(tmp_path / "d.csv", 50)
        counts, last = "training samples 80 → 40, validation samples 20 → 10", 12 + 2 * 4
    else:
        write_csv(tmp_path / "d.csv", 1, start=100)
        counts, last = "training samples 80 → 81, validation samples 20 → 20", 12 + 2 * 9
    refused = cli(tmp_path, "--resume", "auto")
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("polytrain: error: --resume: the data changed since out/checkpoints/step-00000012 ")
    assert "data.path: d.csv is " in line and counts in line
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "out" / "checkpoints")][-1] == "step-00000012"
    accepted = cli(tmp_path, "--resume", "auto", "--accept-changed-data")
    assert accepted.returncode == 0, accepted.stderr
    events = read_metrics(tmp_path / "out")
    resumed = events[[e["event"] for e in events].index("data_changed"):]
    assert [e["step"] for e in resumed if e["event"] == "step"] == list(range(13, last + 1))
    assert [e["epoch"] for e in resumed if e["event"] == "epoch"] == [1, 2]
    assert json.loads((tmp_path / "out" / "model.json").read_text())["global_step"] == last


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_cli_resumes_a_copy_with_new_times_where_it_stood(tmp_path: Path) -> None:
    """Issue 48, item 17 through the CLI: refused before, and --accept-changed-data then repeated epoch 2's steps."""
    (tmp_path / "spec.yaml").write_text(SPEC)
    write_csv(tmp_path / "d.csv", 100)
    assert cli(tmp_path, "--set", "loop.max_steps=12").returncode == 0
    copied_without_times(tmp_path / "d.csv")
    resumed = cli(tmp_path, "--resume", "auto", "--accept-changed-data")
    assert resumed.returncode == 0, resumed.stderr
    events = read_metrics(tmp_path / "out")
    after = events[[e["event"] for e in events].index("resume"):]
    assert [e["step"] for e in after if e["event"] == "step"] == list(range(13, 25))
    assert not any(e["event"] == "data_changed" for e in events)
