"""A TensorFlow job through ``polytrain launch``: no rank prints TensorFlow's C++ start-up notices (absl's
banner, the oneDNN notice, the CPU feature guard) unless the user set ``TF_CPP_MIN_LOG_LEVEL``, in which case
every rank prints them as TensorFlow does (`polytrain.adapters.tensorflow.start`)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from procs import check, loopback_env, run

from polytrain.adapters.tensorflow.start import is_notice

pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

SPEC = """\
framework: tensorflow
backend: mpi
seed: 0
model: {name: mlp, params: {hidden_sizes: [32]}}
data: {name: digits, batch_size: 32, workers: 0}
optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
loop: {epochs: 1}
"""
#: TensorFlow's C++ info lines and the process (thread id) that printed each: which notices a CPU gets differs
#: (oneDNN's is printed on some x86 CPUs only, the CPU feature guard where the binary lacks instructions it has)
INFO = re.compile(r"^I\d{4} [\d:.]+\s+(\d+) \w+\.cc:\d+\] ", re.M)
NOTICE_WORDS = ("oneDNN custom operations", "cpu_feature_guard", "absl::InitializeLog", "To enable the following")


def launch(tmp_path: Path, *flags: str, **env: str) -> tuple[str, dict]:
    """A 2-rank job under mpirun; its whole output and the final manifest."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    environ = loopback_env(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", **env)
    if "TF_CPP_MIN_LOG_LEVEL" not in env:
        del environ["TF_CPP_MIN_LOG_LEVEL"]  # loopback_env quiets TensorFlow itself: as a user's shell, unset
    done = check(run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "mpirun", "-np", "2", *flags,
                      str(spec), "--set", f"output={tmp_path / 'out'}"], env=environ, timeout=480))
    assert done.left_behind == []
    return done.stdout + done.stderr, json.loads((tmp_path / "out" / "model.json").read_text())


def test_no_rank_prints_tensorflows_start_up_notices(tmp_path: Path) -> None:
    text, manifest = launch(tmp_path)
    assert manifest["world_size"] == 2 and manifest["framework"] == "tensorflow"
    notices = [line for line in text.splitlines() if is_notice(line.encode()) or any(w in line for w in NOTICE_WORDS)]
    assert notices == [], text[-3000:]


def test_a_user_who_sets_the_log_level_gets_every_ranks_notices(tmp_path: Path) -> None:
    text, manifest = launch(tmp_path, "-x", "TF_CPP_MIN_LOG_LEVEL", TF_CPP_MIN_LOG_LEVEL="0")
    assert manifest["world_size"] == 2
    assert len(set(INFO.findall(text))) == 2, text[-3000:]  # notices, from both ranks' processes
    assert "absl::InitializeLog" in text


def test_the_notices_and_nothing_else_are_recognised() -> None:
    assert is_notice(b"I0000 00:00:1795693269.001403   28570 port.cc:153] oneDNN custom operations are on.\n")
    assert is_notice(b"I0000 00:00:1795693223.710907   28286 cpu_feature_guard.cc:227] This TensorFlow binary\n")
    assert is_notice(b"To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
                     b"with the appropriate compiler flags.\n")
    assert is_notice(b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")
    assert not is_notice(b"W0000 00:00:1795693269.001403   28570 op_kernel.cc:1] a warning stays\n")
    assert not is_notice(b"E0000 00:00:1795693269.001403   28570 x.cc:1] an error stays\n")
    assert not is_notice(b"Traceback (most recent call last):\n")
