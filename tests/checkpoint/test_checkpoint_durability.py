"""Checkpoint durability (issue 16, items 1-3): rollback keeps the newest save, re-saving a step survives
a crash, and the final model's two files never mix. Crashes are real: a child process patches the
rename it reaches at the chosen moment to call ``os._exit`` there, and the parent reads what is left."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import run

from polytrain.checkpoint import files as cf
from polytrain.checkpoint import store as ckpt

pytestmark = pytest.mark.timeout(120)

CRASHED = 77
CHILD = r"""
import json, os, sys
from pathlib import Path
import numpy as np
from polytrain.checkpoint import store as ckpt
from polytrain.checkpoint import files as cf

p = json.loads(sys.argv[1])
real_replace, real_exchange = os.replace, cf.exchange

def replace(src, dst, *args, **kwargs):
    hit = Path(dst).name.startswith(p["target"])
    if hit and p["when"] == "before":
        os._exit(77)
    real_replace(src, dst, *args, **kwargs)
    if hit and p["when"] == "after":
        os._exit(77)

def exchange(a, b):
    if p["when"] == "before":
        os._exit(77)
    assert real_exchange(a, b), "this file system cannot exchange"
    os._exit(77)

os.replace = replace
if p["exchange"] == "unsupported":
    cf.exchange = lambda a, b: False
elif p["exchange"] == "crash":
    cf.exchange = exchange
state = {"w": np.full(1000, p["version"], np.float32)}
if p["step"] is None:
    ckpt.write_model(Path(p["root"]), state, {"version": p["version"]})
else:
    ckpt.save_checkpoint(Path(p["root"]), p["step"], {"model": state},
                         {"version": p["version"], "world_size": 1, "epoch": 0, "step_in_epoch": 0},
                         keep_last=p["keep_last"])
os._exit(0)
"""


def crash(root: Path, version: int, *, target: str = "\0", when: str = "never", step: int | None = None,
          keep_last: int | None = None, exchange: str = "real") -> int:
    """Run a write (``write_model``, or ``save_checkpoint`` of ``step``) of ``version`` in a child that
    exits on the spot ``when`` ("before"/"after") it renames onto a name starting with ``target``
    (``exchange="crash"``: at the directory exchange). Returns the child's exit code."""
    params = {"root": str(root), "version": version, "target": target, "when": when, "step": step,
              "keep_last": keep_last, "exchange": exchange}
    result = run([sys.executable, "-c", CHILD, json.dumps(params)], timeout=90, cwd=root)
    assert result.returncode in (0, CRASHED), result.stderr[-3000:]
    return result.returncode


def state(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full(1000, version, np.float32)}


def save(root: Path, step: int, version: int, keep_last: int | None = None) -> Path:
    return ckpt.save_checkpoint(root, step, {"model": state(version)},
                                {"version": version, "world_size": 1, "epoch": 0, "step_in_epoch": 0}, keep_last=keep_last)


def steps(paths: list[Path]) -> list[int]:
    return [int(p.name.removeprefix("step-")) for p in paths]


def version_of(checkpoint: Path) -> int:
    """The version a checkpoint holds, after checking that its manifest and tensors agree (and verify)."""
    manifest, tensors = ckpt.load_checkpoint(checkpoint)
    assert np.all(tensors["model"]["w"] == manifest["version"])
    return manifest["version"]


# ---------------------------------------------------------------------------- 1. rollback


def test_rollback_keeps_the_new_save_and_sets_the_abandoned_future_aside(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        save(tmp_path, step, step, keep_last=3)
    new = save(tmp_path, 15, 15, keep_last=2)  # resumed from step 10, saving again
    assert new.is_dir() and (tmp_path / "latest").read_text().strip() == new.name
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [10, 15]
    assert ckpt.find_latest(tmp_path) == new and version_of(new) == 15
    [aside] = tmp_path.glob("abandoned-*")
    assert aside.name.startswith("abandoned-after-step-00000015-")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000020", "step-00000030"]
    assert [version_of(p) for p in sorted(aside.iterdir())] == [20, 30]  # kept whole, for a user to take back
    save(tmp_path, 20, 21, keep_last=2)  # the new line goes on past the old one's steps
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [15, 20] and version_of(ckpt.find_latest(tmp_path)) == 21


def test_keep_last_one_never_removes_the_checkpoint_just_written(tmp_path: Path) -> None:
    save(tmp_path, 10, 10, keep_last=1)
    save(tmp_path, 20, 20, keep_last=1)
    new = save(tmp_path, 5, 5, keep_last=1)
    assert ckpt.complete_checkpoints(tmp_path) == [new] and ckpt.find_latest(tmp_path) == new


def test_best_saves_abandon_nothing_by_default(tmp_path: Path) -> None:
    """``best/`` (no keep_last) is a ranked set that its index.json names: a lower step leaves the rest."""
    save(tmp_path, 30, 30)
    save(tmp_path, 10, 10)
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [10, 30] and not list(tmp_path.glob("abandoned-*"))


def test_the_future_is_set_aside_only_after_the_rollback_save_is_durable(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        save(tmp_path, step, step, keep_last=3)
    # killed just before `latest` moves: the rollback did not happen, nothing was moved
    assert crash(tmp_path, 15, target="latest", when="before", step=15, keep_last=2) == CRASHED
    assert not list(tmp_path.glob("abandoned-*"))
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [10, 15, 20, 30]
    assert ckpt.find_latest(tmp_path).name == "step-00000030"
    # killed just after: `latest` names the new save, which wins over the higher steps still in place
    assert crash(tmp_path, 15, target="latest", when="after", step=15, keep_last=2) == CRASHED
    assert ckpt.find_latest(tmp_path).name == "step-00000015"
    ckpt.prune(tmp_path, 1)  # counts back from what `latest` names; leaves the abandoned steps alone
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [15, 20, 30]
    (tmp_path / "step-00000015" / "model.safetensors").write_bytes(b"damaged")
    save(tmp_path, 12, 12)  # without keep_last (abandons nothing): the fallback order is what matters here
    (tmp_path / "latest").write_text("step-00000015\n")
    assert ckpt.find_latest(tmp_path).name == "step-00000012"  # lower steps before the abandoned higher ones
    save(tmp_path, 16, 16, keep_last=2)  # the next save of the new line sets the old one aside
    assert steps(ckpt.complete_checkpoints(tmp_path)) == [15, 16]
    assert steps(sorted(next(tmp_path.glob("abandoned-*")).iterdir())) == [20, 30]


# ---------------------------------------------------------------------------- 2. re-saving a step


@pytest.mark.parametrize(("exchange", "when", "target", "expect"), [
    ("unsupported", "before", "step-00000020", 1),  # old renamed aside, new not yet in
    ("unsupported", "after", ".replaced-", 1),       # the same moment, seen from the first rename
    ("unsupported", "after", "step-00000020", 2),    # new in place, the old one not yet removed
    ("crash", "before", "\0", 1),                     # renameat2(RENAME_EXCHANGE): just before the swap
    ("crash", "after", "\0", 2),                      # just after it, the old one under the temporary name
], ids=["fallback-between-renames", "fallback-after-aside", "fallback-before-removal", "exchange-before",
        "exchange-after"])
def test_a_crash_while_resaving_a_step_leaves_one_complete_checkpoint(tmp_path: Path, exchange: str, when: str,
                                                                      target: str, expect: int) -> None:
    if exchange == "crash":
        (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
        if not cf.exchange(tmp_path / "a", tmp_path / "b"):
            pytest.skip("this file system cannot exchange two directories (the fallback cases cover it)")
        (tmp_path / "a").rmdir(), (tmp_path / "b").rmdir()
    save(tmp_path, 10, 0, keep_last=3)
    save(tmp_path, 20, 1, keep_last=3)  # the run had finished at step 20; a resume saves step 20 again
    assert crash(tmp_path, 2, target=target, when=when, step=20, keep_last=3, exchange=exchange) == CRASHED
    latest = ckpt.find_latest(tmp_path)
    assert latest is not None and latest.name == "step-00000020"
    assert version_of(latest) == expect
    assert not list(tmp_path.glob(".replaced-*"))  # recovery put the old one back, or dropped it
    save(tmp_path, 20, 3, keep_last=3)  # and the step can be saved again over it
    assert version_of(ckpt.find_latest(tmp_path)) == 3 and not list(tmp_path.glob(".tmp-*"))


def test_a_live_writers_replaced_directory_is_left_to_it(tmp_path: Path) -> None:
    """Between its two renames a saver's old directory is ``.replaced-…-<its pid>-…``: a reader meanwhile
    must not move it back under the step's name (the saver's next rename would then fail)."""
    old = save(tmp_path, 20, 1)
    aside = tmp_path / f".replaced-{old.name}-{os.getpid()}-1"
    os.replace(old, aside)
    assert ckpt.complete_checkpoints(tmp_path) == [] and aside.is_dir()


# ---------------------------------------------------------------------------- 3. the model pair


def read_pair(out: Path) -> int:
    """The version ``read_model`` returns, after checking the tensors agree with model.json, and that the
    files on disk now agree too (a reader that opens model.safetensors itself gets the same)."""
    from safetensors.numpy import load_file

    tensors, manifest = ckpt.read_model(out)
    assert np.all(tensors["w"] == manifest["version"]), "model.safetensors and model.json are from different writes"
    assert np.all(load_file(str(out / "model.safetensors"))["w"] == manifest["version"])
    return manifest["version"]


@pytest.mark.parametrize(("when", "target", "expect"), [
    ("before", "model.json", 1), ("after", "model.json", 2),
    ("before", "model.safetensors", 2), ("after", "model.safetensors", 2),
])
def test_a_crash_while_writing_the_model_leaves_a_matching_pair(tmp_path: Path, when: str, target: str,
                                                                expect: int) -> None:
    ckpt.write_model(tmp_path, state(1), {"version": 1})
    assert crash(tmp_path, 2, target=target, when=when) == CRASHED
    assert read_pair(tmp_path) == expect


def test_a_committed_write_is_finished_before_the_next_one_reuses_its_side_file(tmp_path: Path) -> None:
    ckpt.write_model(tmp_path, state(1), {"version": 1})
    assert crash(tmp_path, 2, target="model.json", when="after") == CRASHED  # committed, tensors not renamed
    assert crash(tmp_path, 3, target="model.json", when="before") == CRASHED  # the next write dies uncommitted
    assert read_pair(tmp_path) == 2


def test_a_first_write_that_crashed_after_its_commit_is_rolled_forward(tmp_path: Path) -> None:
    assert crash(tmp_path, 1, target="model.json", when="after") == CRASHED
    assert not (tmp_path / "model.safetensors").exists()
    assert read_pair(tmp_path) == 1


def test_a_mismatched_pair_is_refused_in_one_line(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    ckpt.write_model(tmp_path, state(1), {"version": 1})
    save_file(state(5), str(tmp_path / "model.safetensors"))  # valid tensors, but not the ones model.json names
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.read_model(tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "model.safetensors") in message and "model.json" in message


def test_a_model_json_without_a_digest_still_loads(tmp_path: Path) -> None:
    """model.json as polytrain wrote it before the digest (no ``safetensors_sha256``)."""
    from safetensors.numpy import save_file

    save_file(state(4), str(tmp_path / "model.safetensors"))
    (tmp_path / "model.json").write_text(json.dumps({"version": 4, "global_step": 7}))
    tensors, manifest = ckpt.read_model(tmp_path)
    assert manifest == {"version": 4, "global_step": 7} and np.all(tensors["w"] == 4)


def test_model_json_records_the_digest_of_its_tensors(tmp_path: Path) -> None:
    ckpt.write_model(tmp_path, state(1), {"version": 1})
    manifest = json.loads((tmp_path / "model.json").read_text())
    assert manifest[cf.DIGEST_KEY] == cf.sha256(tmp_path / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.safetensors"]
