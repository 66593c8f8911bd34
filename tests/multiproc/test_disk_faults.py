"""Disk trouble: an output directory that cannot be created, and checkpoint writes that fail
(the file-size limit stands in for a full disk: writes fail with EFBIG the way they fail with
ENOSPC). One line each, and the previous checkpoint stays intact and resumable."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from procs import check, train

from polytrain.checkpoint import complete_checkpoints, load_checkpoint

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
