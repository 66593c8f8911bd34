"""Two jobs, one output, one nvme_path (issue 48 item 6): each ZeRO-Infinity job has a folder of its own under
``deepspeed.nvme_path`` and holds a lock on it while it lives (`polytrain.adapters.torch.swap_folders`). A second
job started with the same output while the first trains is refused in one line, exit code 2, before it touches
anything: the first job's files are all still there, byte for byte in size, nothing of the second is left, and the
first job trains on to its end. (Before, both named the folder after the output, and the second removed the first's
files at start-up.) One process each, a few steps: the second job is started by the first's callback
(`nvme_hooks.Rival`), so it runs while the first surely holds its files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from procs import CLI, check, job_env, set_args, train

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]
pytest.importorskip("deepspeed")

HOOKS_DIR = str(Path(__file__).parent)
SETS = ["backend=deepspeed", "deepspeed.stage=3", "deepspeed.offload_optimizer=nvme", "deepspeed.offload_param=nvme",
        "model.params.hidden_sizes=[2048,1024]", "loop.max_steps=3", "optimizer.name=sgd", "optimizer.momentum=0.9",
        "data.global_batch_size=32"]


def test_a_second_job_with_the_same_output_is_refused_and_leaves_the_first_jobs_files(tmp_path: Path) -> None:
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    sets = [*SETS, f"deepspeed.nvme_path={nvme}"]
    env = {"PYTHONPATH": HOOKS_DIR}
    rival = {"cmd": [sys.executable, *CLI, "train", "--quiet", *set_args([f"output={out}", *sets])],
             "env": job_env(env)}
    first = check(train(out, [*sets, "callbacks=[nvme_hooks:Rival]"], timeout=600,
                        env={**env, "NVME_RIVAL": json.dumps(rival)}))
    seen = json.loads((out / "rival.json").read_text())
    folder = next(iter(seen["before"])).split("/")[0]
    assert any("/zero_stage_3/optimizer/rank0/" in name for name in seen["before"]), seen["before"]
    assert any("/zero_stage_3/float32params/rank0/" in name for name in seen["before"]), seen["before"]
    assert seen["after"] == seen["before"]  # the first job's files, untouched; nothing of the second left
    assert f"{folder}/.polytrain-lock" in seen["before"]
    assert seen["code"] == 2, seen["stderr"][-3000:]
    assert seen["stderr"].strip().splitlines()[-1] == (
        f"polytrain: error: deepspeed.nvme_path: {nvme.resolve() / folder} holds the offloaded files of another job "
        f"with output {out.resolve()}, still running; wait for it to end, or give this job another output (rank 0)")
    assert "Traceback" not in seen["stderr"]
    assert first.returncode == 0 and not list(nvme.iterdir())  # the first trained on, and cleared its folder
