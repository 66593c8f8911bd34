"""``polytrain checkpoint import`` of DeepSpeed's own checkpoint directory, written by a real 2-rank ZeRO run.

The run (digits MLP, Adam, ``deepspeed.save_checkpoint: true``) leaves DeepSpeed's checkpoint of its
last step in ``<output>/deepspeed_checkpoint``. Imported, it must hold exactly the run's final weights,
and a run resumed from it must evaluate to the run's validation accuracy. That run takes one SGD step
with a learning rate of 1e-30, below half an ulp of every weight that matters, so it evaluates the
imported weights themselves, through the Trainer's own evaluation. ZeRO-0 is read with
``weights_only=True``; ZeRO-3 needs DeepSpeed's loader, which unpickles, so it is refused without
``--trust-checkpoint``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, check, free_port, run

from polytrain.checkpoint.store import load_checkpoint, read_model

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(400)]

SPEC = ["optimizer.name=adam", "optimizer.lr=0.01", "optimizer.momentum=0.0", "data.batch_size=32",
        "model.params.hidden_sizes=[64]", "loop.epochs=2"]
CLI = [sys.executable, "-m", "polytrain.cli"]


def sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_checkpoint_imports_with_the_runs_weights_and_accuracy(stage: int, tmp_path: Path) -> None:
    out = tmp_path / "run"
    check(run([str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "-m", "polytrain.cli", "train", "--quiet",
               *sets([*SPEC, "backend=deepspeed", f"deepspeed.stage={stage}", "deepspeed.save_checkpoint=true",
                      f"output={out}"])]))
    weights, manifest = read_model(out)
    assert manifest["val_accuracy"] > 0.9 and manifest["global_step"] == 46
    native = out / "deepspeed_checkpoint"
    assert (native / "latest").read_text().strip() == "global_step46"

    imported = tmp_path / "imported"
    command = [*CLI, "checkpoint", "import", str(native), *sets(SPEC), "-o", str(imported)]
    if stage > 0:
        refused = run(command)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
        assert "needs pickle to load" in refused.stderr and "--trust-checkpoint" in refused.stderr
        assert not imported.exists()
        command.append("--trust-checkpoint")
    check(run(command))
    ckpt_manifest, tensors = load_checkpoint(imported / "step-00000000")
    assert ckpt_manifest["backend"] == "import" and set(tensors) == {"model"}
    assert set(tensors["model"]) == set(weights)
    for name, value in weights.items():
        assert tensors["model"][name].dtype == np.float32
        np.testing.assert_array_equal(tensors["model"][name], value, err_msg=name)

    again = tmp_path / "again"
    check(run([*CLI, "train", "--quiet", "--resume", str(imported / "step-00000000"),
               *sets([*SPEC, "optimizer.name=sgd", "optimizer.lr=1.0e-30", "loop.max_steps=1", f"output={again}"])]))
    resumed_weights, resumed = read_model(again)
    assert resumed["global_step"] == 1
    for name, value in weights.items():
        np.testing.assert_allclose(resumed_weights[name], value, rtol=0, atol=1e-20, err_msg=name)
    assert resumed["val_accuracy"] == manifest["val_accuracy"]
