"""Disk trouble: an output directory that cannot be created, and checkpoint writes that fail
(the file-size limit stands in for a full disk: writes fail with EFBIG the way they fail with
ENOSPC). One line each, and the previous checkpoint stays intact and resumable."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import check, read_metrics, train

from polytrain.checkpoint.store import complete_checkpoints, load_checkpoint
from polytrain.observe.metrics import read_records

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

SETS = ["model.params.hidden_sizes=[512]", "loop.epochs=2", "checkpoint.every_n_steps=10", "loop.log_every_n_steps=50"]
LIMITED = """\
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
limit = int(os.environ["FILE_SIZE_LIMIT"])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def limited(folder: Path) -> list[str]:
    """A Python that runs under the file-size limit ``$FILE_SIZE_LIMIT``."""
    wrapper = folder / "limited.py"
    wrapper.write_text(LIMITED)
    return [sys.executable, str(wrapper)]


def test_output_that_cannot_be_created_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = train(tmp_path / "out", [*SETS, f"output={blocker / 'run'}"], timeout=200)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"polytrain: error: output: cannot write to {blocker / 'run'} (Not a directory); choose a writable directory"]


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_failed_checkpoint_write_keeps_the_previous_one_and_resumes(tmp_path: Path, background: bool) -> None:
    """Written in the background (``checkpoint.async_save``) the failure is known at the next save: the same line."""
    out = tmp_path / "run"
    sets = [*SETS, f"checkpoint.async_save={str(background).lower()}"]
    check(train(out, [*sets, "loop.max_steps=20"], timeout=200))
    root = out / "checkpoints"
    before = complete_checkpoints(root)
    assert [p.name for p in before] == ["step-00000010", "step-00000020"]
    model_bytes = (before[-1] / "model.safetensors").stat().st_size
    # resume with every file capped below a checkpoint's size: the save at step 30 fails
    result = train(out, sets, resume="auto", python=limited(tmp_path), env={"FILE_SIZE_LIMIT": str(model_bytes // 2)},
                   timeout=200)
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"polytrain: error: checkpoint.dir: cannot write the checkpoint of step 30 under {root} "
                    f"(File too large); the previous checkpoint {before[-1]} is intact; free space or choose "
                    "another checkpoint.dir, then resume with --resume auto"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert complete_checkpoints(root) == before and not list(root.glob(".tmp-*"))
    assert (root / "latest").read_text().strip() == "step-00000020"
    manifest, _ = load_checkpoint(before[-1])  # verifies every file's checksum
    assert manifest["global_step"] == 20
    check(train(out, sets, resume="auto", timeout=200))  # space is back: the run continues from step 20 and finishes
    assert json.loads((out / "model.json").read_text())["global_step"] == 90  # 2 epochs of ceil(1437 / 32)


# ---------------------------------------------------------------------------- issue 48: checked up front, full disks


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_checkpoint_dir_that_cannot_be_written_is_refused_before_training(tmp_path: Path, background: bool) -> None:
    """Item 11: it trained an epoch and failed at the first save (with checkpoint.async_save, trained every epoch,
    failed with "no earlier checkpoint exists" and wrote no final model). Probed as output is: one line, exit 2."""
    out = tmp_path / "out"
    result = train(out, ["checkpoint.dir=/proc/x", "checkpoint.every_n_epochs=1", "loop.epochs=2",
                         f"checkpoint.async_save={str(background).lower()}"], timeout=200)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "polytrain: error: checkpoint.dir: cannot write to /proc/x (No such file or directory); choose a writable "
        "directory"]
    assert not (out / "metrics.jsonl").exists()  # not a step trained, not a record written


PAGE = 4096


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (skipped where this process may not mount one), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                             text=True, timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], check=True, timeout=60)


def fill(disk: Path, free_pages: int = 0) -> Path:
    """Fill ``disk`` with one file, then give ``free_pages`` pages back; returns the file."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as file:
        try:
            while True:
                file.write(b"\0" * PAGE)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    os.truncate(filler, max(filler.stat().st_size // PAGE - free_pages, 0) * PAGE)
    return filler


def test_a_full_output_disk_in_the_metrics_log_is_one_line_and_the_newest_checkpoint_resumes(
        tmp_path: Path, small_disk: Path) -> None:
    """Item 12: an `OSError: [Errno 28]` traceback from MetricsLog.write. One page left on the output's disk: the
    log of every step fills it; checkpoints are on another disk."""
    out, root = small_disk / "out", tmp_path / "ckpt"
    out.mkdir()
    sets = ["loop.epochs=1", "loop.log_every_n_steps=1", "checkpoint.every_n_steps=5", f"checkpoint.dir={root}",
            "logging.csv=false", "logging.tensorboard=false"]
    filler = fill(small_disk, free_pages=1)
    result = train(out, sets, timeout=200)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"polytrain: error: output: cannot write {out / 'metrics.jsonl'} (No space left on device); free space or "
        "choose another output directory, then resume with --resume auto")
    records, _ = read_records(out / "metrics.jsonl")
    logged = [r["step"] for r in records if r["event"] == "step"]
    newest = complete_checkpoints(root)[-1]
    assert (root / "latest").read_text().strip() == newest.name and not list(root.glob(".tmp-*"))
    step = load_checkpoint(newest)[0]["global_step"]  # verifies every file's checksum
    assert step == logged[-1] // 5 * 5 and 5 <= step < 45 and not (out / "model.json").exists()
    filler.unlink()  # space is back: the run goes on from that checkpoint
    check(train(out, sets, resume="auto", timeout=200))
    records, _ = read_records(out / "metrics.jsonl")  # the line the full disk cut short stays apart from the next
    assert [r["step"] for r in records if r["event"] == "resume"] == [step]
    assert json.loads((out / "model.json").read_text())["global_step"] == 45


@pytest.mark.parametrize("name", ["metrics.csv", "tb"])
def test_the_csv_and_tensorboard_writers_on_a_full_disk_are_one_line(tmp_path: Path, small_disk: Path,
                                                                      name: str) -> None:
    """Item 12: the CSV and TensorBoard writers likewise. Only that file is on the full disk (a link to it), so
    that its writer is the one to fail."""
    out = tmp_path / "out"
    out.mkdir()
    (small_disk / "tb").mkdir()
    (out / name).symlink_to(small_disk / name)
    fill(small_disk)
    result = train(out, ["loop.max_steps=3", "loop.log_every_n_steps=1"], timeout=200)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    file = f"{out / 'tb'}/events.out.tfevents.[^ ]+" if name == "tb" else re.escape(str(out / name))
    assert re.fullmatch(f"polytrain: error: output: cannot write {file} \\(No space left on device\\); free space "
                        "or choose another output directory, then resume with --resume auto", last), last
    # metrics.jsonl, on another disk, has what was written before: the CSV's header is written as the log opens
    assert [r["step"] for r in read_metrics(out, "step")] == ([1] if name == "tb" else [])


@pytest.mark.parametrize("what", ["timeline", "profile"])
def test_a_timeline_or_profile_trace_on_a_full_disk_is_one_line(tmp_path: Path, small_disk: Path, what: str) -> None:
    """Item 12, every file the run writes: --timeline on a full disk was exit 2 ("give a path in a writable
    directory", although the path was fine); torch.profiler left no trace, or an empty one, without a word."""
    out = tmp_path / "out"
    out.mkdir()
    (small_disk / "profile").mkdir()
    if what == "profile":
        (out / "profile").symlink_to(small_disk / "profile")
    fill(small_disk)
    timeline = small_disk / "t.json"
    args = ["--timeline", str(timeline)] if what == "timeline" else ["--profile", "1:2"]
    result = train(out, ["loop.max_steps=3"], args=args, timeout=200)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    expected = (f"--timeline {timeline}: cannot write it (No space left on device); free space or give a path on "
                "another disk") if what == "timeline" else (
        f"profile: {out / 'profile' / 'rank0.pt.trace.json'} was not written whole (is the disk full?); free space "
        "or choose another output directory")
    assert result.stderr.strip().splitlines()[-1] == f"polytrain: error: {expected}"
