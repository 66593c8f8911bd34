"""An exception in the user's own code ends with the user's frames and one line naming the hook (issue 26, 16).

Through the real CLI (``python -m polytrain.cli train``): for a loss, a metric, a callback, a transform, a dataset
factory and a model factory that raise, stderr is the user's frames (file, line, source) and one last line
``polytrain: error in <hook> '<name>' (user code): <Type>: <message>`` — no frame of polytrain or of an installed
library — and the exit code is 1 (the spec was valid; the run failed in code polytrain called). In a job of two
ranks, that line names the rank. ``--debug`` still shows the whole traceback. TensorFlow traces a loss in a
``tf.function``: there the line stands alone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from procs import BIN, Finished, free_port, loopback_env, run

pytest.importorskip("torch")

HOOKS = '''\
import os


def bad_loss(out, y):
    return share(len(y), 0)


def share(total, parts):
    return total // parts


def bad_metric(out, y):
    raise ValueError("metric exploded")


def bad_transform(x, y):
    return x.reshape(-1, 7), y


class BadCallback:
    def on_step_end(self, run, step, logs):
        if step == 2:
            raise KeyError("no_such_log")


def bad_model(info, **params):
    raise RuntimeError(f"cannot build a model for {info.num_outputs} classes")


def bad_dataset():
    return {"train": [][5]}


def rank1_loss(out, y):
    if os.environ["RANK"] == "1":
        raise ArithmeticError("rank 1 lost count")
    return (out.float() * 0).sum(dim=1)
'''

#: hook: (--set, the last line's hook and name, the exception's line, the raising source lines, the user's frames)
CASES = {
    "loss": ("loss=user_hooks:bad_loss", "loss 'user_hooks:bad_loss'",
             "ZeroDivisionError: integer division or modulo by zero",
             ["return share(len(y), 0)", "return total // parts"]),
    "metric": ("metrics=[accuracy,user_hooks:bad_metric]", "metrics[1] 'user_hooks:bad_metric'",
               "ValueError: metric exploded", ['raise ValueError("metric exploded")']),
    "callback": ("callbacks=[user_hooks:BadCallback]", "callback on_step_end 'user_hooks:BadCallback'",
                 "KeyError: 'no_such_log'", ['raise KeyError("no_such_log")']),
    "transform": ("data.transform=user_hooks:bad_transform", "data.transform 'user_hooks:bad_transform'",
                  "ValueError: cannot reshape array of size ", ["return x.reshape(-1, 7), y"]),
    "dataset factory": ("data.factory=user_hooks:bad_dataset", "data.factory 'user_hooks:bad_dataset'",
                        "IndexError: list index out of range", ['return {"train": [][5]}']),
    "model factory": ("model.name=user_hooks:bad_model", "model.name 'user_hooks:bad_model'",
                      "RuntimeError: cannot build a model for 10 classes",
                      ['raise RuntimeError(f"cannot build a model for {info.num_outputs} classes")']),
}
COMMON = ["loop.epochs=1", "loop.max_steps=3", "data.global_batch_size=64"]


@pytest.fixture
def hooks(tmp_path: Path) -> Path:
    (tmp_path / "user_hooks.py").write_text(HOOKS)
    return tmp_path


def train(hooks: Path, sets: list[str], *extra: str, launcher: list[str] | None = None) -> Finished:
    args = [a for s in [*COMMON, *sets, f"output={hooks / 'out'}"] for a in ("--set", s)]
    prefix = launcher or [sys.executable]
    return run([*prefix, "-m", "polytrain.cli", *extra, "train", "--quiet", *args],
               env=loopback_env(PYTHONPATH=str(hooks)), cwd=hooks, timeout=240)


def line_of(source: str) -> int:
    return next(i for i, line in enumerate(HOOKS.splitlines(), start=1) if line.strip() == source)


def no_library_frames(err: str) -> None:
    """No frame of polytrain's own modules or of anything installed (torch, numpy, the standard library)."""
    files = re.findall(r'File "([^"]+)"', err)
    assert files and all(Path(f).name == "user_hooks.py" for f in files), err


@pytest.mark.parametrize("hook", list(CASES))
@pytest.mark.slow
def test_user_code_raising_ends_with_its_frames_and_the_hook(hooks: Path, hook: str) -> None:
    setting, named, exception, sources = CASES[hook]
    sets = [setting, "data.name=dataset"] if hook == "dataset factory" else [setting]
    result = train(hooks, sets)
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"polytrain: error in {named} (user code): {exception}"), err[-3000:]
    no_library_frames(err)
    for source in sources:  # every user frame: file, line and source line, in order
        assert f'File "{hooks / "user_hooks.py"}", line {line_of(source)}, in ' in err, err[-3000:]
        assert f"    {source}\n" in err, err[-3000:]
    assert err.index(sources[0]) < err.index(last)


@pytest.mark.slow
def test_a_tensorflow_loss_traced_in_a_step_is_named_the_same_way(hooks: Path) -> None:
    """TensorFlow traces the loss inside a ``tf.function`` and raises its own exception over the user's: the
    user's error still ends the run in the one line (autograph's generated frames are not shown)."""
    pytest.importorskip("tensorflow")
    result = train(hooks, ["framework=tensorflow", "loss=user_hooks:bad_metric"])
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == ("polytrain: error in loss 'user_hooks:bad_metric' (user code): "
                                                      "ValueError: metric exploded")
    assert 'File "' not in result.stderr  # no frame of TensorFlow's, polytrain's or autograph's


@pytest.mark.slow
def test_debug_shows_the_whole_traceback(hooks: Path) -> None:
    result = train(hooks, [CASES["loss"][0]], "--debug")
    assert result.returncode == 1
    assert 'polytrain/train/trainer.py", line' in result.stderr and "ZeroDivisionError" in result.stderr


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_rank_of_a_two_rank_job_names_itself(hooks: Path) -> None:
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    result = train(hooks, ["loss=user_hooks:rank1_loss", "backend=ddp", "reliability.collective_timeout_s=30"],
                   launcher=torchrun)
    err = result.stderr
    assert result.returncode != 0
    lines = [line for line in err.splitlines() if "(user code)" in line]
    assert lines == ["polytrain: rank 1: error in loss 'user_hooks:rank1_loss' (user code): ArithmeticError: rank 1 "
                     "lost count"], err[-3000:]
    raising = line_of('raise ArithmeticError("rank 1 lost count")')
    assert f'File "{hooks / "user_hooks.py"}", line {raising}, in rank1_loss' in err, err[-3000:]
    assert not result.left_behind
