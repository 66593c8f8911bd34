"""A Trainer rank imports TensorFlow and Keras without Keras's optional scikit-learn, matplotlib and pandas
parts (adapters/tensorflow/start.py), and those packages still import afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

PROBE = """
import json, os, sys
{before}
from polytrain.adapters.tensorflow.start import import_tensorflow_quietly
import_tensorflow_quietly()
from keras.src.trainers.data_adapters import array_slicing
loaded = sorted(m for m in ("sklearn", "matplotlib", "pandas") if m in sys.modules)
keras_sees_pandas = array_slicing.pandas is not None
import pandas, sklearn.base  # offered again once Keras is in
print(json.dumps({{"loaded": loaded, "keras_sees_pandas": keras_sees_pandas,
                  "finders": [type(f).__name__ for f in sys.meta_path]}}))
"""


def probe(before: str = "", **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_keras_is_imported_without_its_optional_extras() -> None:
    got = probe()
    assert got["loaded"] == []
    assert got["keras_sees_pandas"] is False
    assert "_LeaveOut" not in got["finders"]


def test_an_extra_the_script_imported_first_is_left_to_keras_also_with_tf_logs_on() -> None:
    got = probe(before="import pandas", TF_CPP_MIN_LOG_LEVEL="0")
    assert got["loaded"] == ["pandas"]
    assert got["keras_sees_pandas"] is True
    assert "_LeaveOut" not in got["finders"]
