"""``checkpoint.async_save``: a process SIGKILLed while a background save is being written leaves the previous
checkpoint the newest complete one, and ``--resume auto`` ends with exactly the weights of an uninterrupted run.
(The same checkpoints as synchronous saves: tests/test_trainer_checkpoints.py; a failed background write on every
rank: test_disk_faults.py, test_rank0_failures.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from procs import check, read_metrics, train

from polytrain.checkpoint.store import complete_checkpoints, load_checkpoint, read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).parent
SETS = ["model.name=kill_mid_save:make", "model.params={}", "optimizer.name=adam", "optimizer.lr=0.001",
        "loop.max_steps=12", "checkpoint.every_n_steps=2", "checkpoint.async_save=true", "checkpoint.keep_last=2"]


def test_a_kill_during_a_background_save_keeps_the_previous_checkpoint_and_resumes_exactly(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    check(train(straight, SETS, env={"PYTHONPATH": str(HERE)}))
    out = tmp_path / "killed"
    root = out / "checkpoints"
    killed = train(out, SETS, env={"PYTHONPATH": str(HERE), "KILL_MID_SAVE": str(root)})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert list(root.glob(".tmp-step-*")), "the kill did not land during a background save"
    kept = complete_checkpoints(root)
    assert kept and (root / "latest").read_text().strip() == kept[-1].name
    for path in kept:
        load_checkpoint(path)  # every file's size and checksum verified
    check(train(out, SETS, resume="auto", env={"PYTHONPATH": str(HERE)}))
    assert [r["step"] for r in read_metrics(out, "resume")] == [int(kept[-1].name.split("-")[1])]
    want, _ = read_model(straight)
    got, manifest = read_model(out)
    assert manifest["global_step"] == 12 and sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not list(root.glob(".tmp-step-*"))  # the resumed run's saves cleared the dead write's leftovers
    # its later saves copied into the arrays of the save before: the last one holds the final weights
    saved, tensors = load_checkpoint(complete_checkpoints(root)[-1])
    assert saved["global_step"] == 12
    for name in want:
        np.testing.assert_array_equal(tensors["model"][name], want[name], err_msg=name)
