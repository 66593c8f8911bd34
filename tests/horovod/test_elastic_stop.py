"""hvd.elastic's preemption table from the environment (polytrain/horovod/common/elastic_stop.py): off unless asked
for, each bad value one line naming its variable; the mark a preempted job leaves holds for one start."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.errors import UserError
from polytrain.horovod.common import elastic_stop


def test_off_unless_signals_are_named_and_the_defaults_otherwise() -> None:
    assert elastic_stop.preemption_table({}) is None and elastic_stop.preemption_table({elastic_stop.SIGNALS: " "}) is None
    table = elastic_stop.preemption_table({elastic_stop.SIGNALS: "SIGTERM, usr1"})
    assert table is not None and (table.signals, table.grace_s, table.requeue) == (("SIGTERM", "usr1"), 120.0, "auto")


@pytest.mark.parametrize(("env", "named"), [
    ({elastic_stop.SIGNALS: "SIGTERM,SIGKILL"}, "POLYTRAIN_PREEMPTION_SIGNALS='SIGTERM,SIGKILL': preemption.signals[1]"),
    ({elastic_stop.SIGNALS: "TERM", elastic_stop.GRACE: "0"}, "POLYTRAIN_PREEMPTION_GRACE_S='0'"),
    ({elastic_stop.SIGNALS: "TERM", elastic_stop.GRACE: "soon"}, "POLYTRAIN_PREEMPTION_GRACE_S='soon'"),
    ({elastic_stop.SIGNALS: "TERM", elastic_stop.REQUEUE: "maybe"}, "POLYTRAIN_PREEMPTION_REQUEUE='maybe': one of"),
])
def test_a_bad_value_is_one_line_naming_its_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(UserError) as caught:
        elastic_stop.preemption_table(env)
    assert str(caught.value).startswith(named) and "\n" not in str(caught.value)


def test_the_mark_holds_for_one_start_in_a_private_directory_only(tmp_path: Path) -> None:
    private = tmp_path / "state"
    private.mkdir(mode=0o700)
    assert not elastic_stop.take_mark(private) and not elastic_stop.take_mark(tmp_path / "absent")
    elastic_stop.mark(private)
    assert elastic_stop.take_mark(private) and not elastic_stop.take_mark(private)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    elastic_stop.mark(shared)
    assert not elastic_stop.take_mark(shared) and (shared / elastic_stop.MARK).exists()  # not trusted, kept


TF_JOB = """
import os, signal, sys
import tensorflow as tf
import polytrain.horovod.tensorflow as hvd
hvd.init()
weights = tf.Variable([0.0, 0.0])
state = hvd.elastic.TensorFlowState(variables=[weights], epoch=0)

@hvd.elastic.run
def train(state):
    print("START", state.epoch, weights.numpy().tolist(), flush=True)
    for epoch in range(state.epoch, 5):
        weights.assign_add([1.0, 2.0])
        state.epoch = epoch + 1
        if epoch == 1 and not os.environ.get("RESUMED"):
            os.kill(os.getpid(), signal.SIGUSR1)
        state.commit()

train(state)
print("DONE", state.epoch, weights.numpy().tolist(), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_tensorflow_shim_stops_at_the_commit_and_resumes_there(tmp_path: Path) -> None:
    """One TensorFlow process under the shim: SIGUSR1 in epoch 2 stops it after that commit (75); the next start
    resumes from it and ends where an uninterrupted run ends."""
    import os
    import subprocess
    import sys

    pytest.importorskip("tensorflow")
    env = {**os.environ, "POLYTRAIN_HOROVOD_IMPL": "shim", "POLYTRAIN_HOROVOD_ELASTIC_DIR": str(tmp_path / "state"),
           elastic_stop.SIGNALS: "SIGUSR1", elastic_stop.REQUEUE: "never", "TF_CPP_MIN_LOG_LEVEL": "3"}
    first = subprocess.run([sys.executable, "-c", TF_JOB], env=env, capture_output=True, text=True, timeout=200)
    assert first.returncode == 75 and "DONE" not in first.stdout, first.stderr[-2000:]
    assert "polytrain: preempted by SIGUSR1: every rank stopped after step 2" in first.stderr
    second = subprocess.run([sys.executable, "-c", TF_JOB], env={**env, "RESUMED": "1"}, capture_output=True,
                            text=True, timeout=200)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "START 2 [2.0, 4.0]" in second.stdout and "DONE 5 [5.0, 10.0]" in second.stdout, second.stdout
