"""data.worker_kind: images decoded in separate processes give the same bytes as decoding in the reading thread,
report bad files in one line, and never outlive the training process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL.Image")

from polytrain.data.images import open_images  # noqa: E402
from polytrain.errors import SpecError  # noqa: E402
from polytrain.spec.tables import DataSpec  # noqa: E402
from polytrain.validation import from_dict  # noqa: E402
from tests.data.test_images import write_tree  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def decoders(parent: int) -> set[int]:
    """Pids of the image decoding processes whose parent is ``parent``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"polytrain_image_decode" in cmdline and int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def images(tmp_path: Path, **fields: object) -> DataSpec:
    write_tree(tmp_path / "tree", {"ant": 7, "bee": 6, "cat": 8}, suffix=".jpg", size=(9, 11))
    return DataSpec(**{"name": "images", "path": str(tmp_path / "tree"), "val_fraction": 0.0,  # type: ignore[arg-type]
                       "mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3), "image_size": (8, 10), **fields})


def test_processes_and_threads_decode_identical_batches(tmp_path: Path) -> None:
    threads = open_images(images(tmp_path, worker_kind="threads"), seed=0).train
    procs = open_images(images(tmp_path, worker_kind="processes", workers=3), seed=0).train
    assert (threads.processes, procs.processes) == (0, 3)
    order = threads.order(3, 0)
    try:
        for start in range(0, len(order), 5):  # the buffer grows once (the first batch is the largest but one)
            idx = order[start:start + (5 if start else 2)]
            (xt, yt), (xp, yp) = threads.read(idx), procs.read(idx)
            assert xp.dtype == np.float32 and xp.shape == (len(idx), 3 * 8 * 10)
            np.testing.assert_array_equal(xp, xt)
            np.testing.assert_array_equal(yp, yt)
        for source in (threads, procs):  # an empty micro-batch (a rank with no samples left) reads as empty
            x, y = source.read(np.zeros(0, dtype=np.int64))
            assert x.shape == (0, 240) and y.shape == (0,)
        assert procs._pool is not None
        started = set(procs._pool.pids())
        assert len(started) == 3 and started <= decoders(os.getpid())
    finally:
        procs.close()
    assert not started & decoders(os.getpid()) and not any(alive(p) for p in started)
    with pytest.raises(SpecError, match=r"^data\.worker_kind: the image decoding processes were closed"):
        procs.read(order[:2])  # a read after close says so (it does not restart or hang)


def test_auto_decodes_in_processes_only_with_reader_workers(tmp_path: Path) -> None:
    assert open_images(images(tmp_path), seed=0).train.processes == 2
    assert open_images(images(tmp_path, workers=0), seed=0).train.processes == 0


def test_a_bad_file_is_one_line_naming_the_field_and_the_file(tmp_path: Path) -> None:
    spec = images(tmp_path, worker_kind="processes")
    bad = sorted((tmp_path / "tree" / "bee").iterdir())[2]
    bad.write_bytes(b"\xff\xd8 not really a jpeg")
    source = open_images(spec, seed=0).train
    try:
        index = [str(f) for f in source.files].index(str(bad))
        with pytest.raises(SpecError, match=rf"^data\.path: cannot decode image {bad}: ") as caught:
            source.read(np.array([0, index, 1]))
        assert "\n" not in str(caught.value)
        x, _ = source.read(np.array([0, 1]))  # the process goes on serving the next batch
        assert x.shape == (2, 240)
    finally:
        source.close()


def test_a_decoding_process_that_dies_is_an_error_not_a_hang(tmp_path: Path) -> None:
    source = open_images(images(tmp_path, worker_kind="processes", workers=1), seed=0).train
    try:
        source.read(np.array([0]))
        assert source._pool is not None
        (pid,) = source._pool.pids()
        os.kill(pid, signal.SIGKILL)
        for _ in range(2):  # the read that finds it gone, and every read after
            with pytest.raises(SpecError, match=r"^data\.worker_kind: an image decoding process \(pid \d+\) ended"):
                source.read(np.array([1, 2]))
    finally:
        source.close()


WORKER = """
import json, os, signal, sys
import numpy as np
from polytrain.data.images import open_images
from polytrain.spec.tables import DataSpec
source = open_images(DataSpec(name="images", path=sys.argv[1], val_fraction=0.0, workers=2), seed=0).train
source.read(np.arange(4))
print(json.dumps(sorted(source._pool.pids())), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_no_decoding_process_outlives_a_killed_training_process(tmp_path: Path) -> None:
    images(tmp_path)
    done = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / "tree")], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGKILL, done.stderr
    pids = json.loads(done.stdout)
    assert len(pids) == 2
    deadline = time.monotonic() + 60  # a wait for them to go, not a timing assertion
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "parquet", "path": "t.parquet", "features": ("x",), "label": "y", "worker_kind": "processes"},
     "data.worker_kind: processes decode images (data.name images, data.workers 1 or more); data.name 'parquet'"),
    ({"name": "images", "path": ".", "workers": 0, "worker_kind": "processes"},
     "data.worker_kind: processes decode images (data.name images, data.workers 1 or more); data.name 'images' "
     "with data.workers 0"),
    ({"name": "images", "path": ".", "worker_kind": "forks"}, "data.worker_kind"),
])
def test_worker_kind_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: dict, message: str) -> None:
    (tmp_path / "t.parquet").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as caught:
        from_dict({"data": fields}, validate_components=False)
    assert str(caught.value).startswith(message)


def test_worker_kind_is_not_part_of_the_model_digest() -> None:
    plain = from_dict({"data": {"name": "images", "path": "."}}, validate_components=False)
    threads = from_dict({"data": {"name": "images", "path": ".", "worker_kind": "threads"}}, validate_components=False)
    assert plain.model_digest() == threads.model_digest()
