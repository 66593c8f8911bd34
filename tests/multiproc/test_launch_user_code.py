"""``polytrain launch`` checks a spec before starting the ranks but imports none of the code it names: the
workers may reach a module only through ``-x PYTHONPATH=DIR``, which the launching process does not have."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from procs import check, loopback_env, read_metrics, run

from polytrain.errors import SpecError
from polytrain.launchers.args import check_spec

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

MODULE = "polytrain_test_user_code_14"
CODE = """\
import os
from pathlib import Path

import torch

if os.environ.get("POLYTRAIN_TEST_IMPORT_MARKS"):  # where each importing process leaves its pid
    Path(os.environ["POLYTRAIN_TEST_IMPORT_MARKS"], str(os.getpid())).touch()


def loss(out, y):
    return torch.nn.functional.cross_entropy(out, y, reduction="none")


def wrong(out, y):
    return (out.argmax(1) != y).float()


def transform(x, y):
    return x, y


class Marks:
    def on_train_end(self, run, result):
        Path(run.spec.output, f"callback-rank{run.rank}").touch()
"""


def user_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(f"""\
        framework: torch
        backend: ddp
        model: {{name: mlp, params: {{hidden_sizes: [32]}}}}
        data: {{name: digits, batch_size: 32, val_fraction: 0.2, transform: "{MODULE}:transform", workers: 0}}
        loss: "{MODULE}:loss"
        metrics: [accuracy, "{MODULE}:wrong"]
        callbacks: ["{MODULE}:Marks"]
        optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
        loop: {{epochs: 2}}
        output: {tmp_path / "out"}
        """))
    return spec


def test_a_loss_metric_callback_and_transform_reachable_only_through_x_pythonpath_train(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{MODULE}.py").write_text(CODE)
    marks = tmp_path / "imported"
    marks.mkdir()
    env = loopback_env(POLYTRAIN_TEST_IMPORT_MARKS=str(marks))
    env.pop("PYTHONPATH", None)
    launch = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "2",
              "-x", f"PYTHONPATH={code}", "-x", "POLYTRAIN_TEST_IMPORT_MARKS", str(user_spec(tmp_path))]
    done = check(run(launch, env=env, timeout=240))
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("callback-rank*")) == ["callback-rank0", "callback-rank1"]
    last = read_metrics(out)[-1]
    assert 0.0 <= last["val_wrong"] <= 1.0 and last["val_wrong"] == pytest.approx(1.0 - last["val_accuracy"]), last
    assert len(list(marks.iterdir())) == 2, done.stderr  # the two ranks imported it, the launching process could not
    assert done.left_behind == []


def test_the_launch_check_imports_nothing_but_still_checks_the_rest(tmp_path: Path) -> None:
    spec = user_spec(tmp_path)
    assert MODULE not in sys.modules
    check_spec([str(spec)], world_size=2)
    assert MODULE not in sys.modules
    with pytest.raises(SpecError, match="^loss: 'hinge' is not a built-in loss"):
        check_spec([str(spec), "--set", "loss=hinge"], world_size=2)
    with pytest.raises(SpecError, match="^metrics\\[1\\]: ':wrong' is not an import path"):
        check_spec([str(spec), "--set", "metrics=[accuracy, ':wrong']"], world_size=2)
