"""The TensorFlow package's layout: real and shim export the same names; one op/average rule.

Checked in a subprocess, so TensorFlow stays out of the test process.
"""

from __future__ import annotations

import json
import sys

import pytest
from procs import check, run

PROBE = """
import json
from polytrain.horovod import common
from polytrain.horovod.common import _import_error
import polytrain.horovod.tensorflow as hvd
from polytrain.horovod.tensorflow import _shim, collectives
out = {"shim": sorted(_shim.__all__), "shim_bound": all(hasattr(_shim, n) for n in _shim.__all__),
       "same_rule": collectives.handle_average_backwards_compatibility is common.resolve_average,
       "impl": hvd.IMPL}
if _import_error("horovod.tensorflow") is None:
    from polytrain.horovod.tensorflow import _real
    out["real"] = sorted(_real.__all__)
    out["real_bound"] = all(hasattr(_real, n) for n in _real.__all__)
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_real_and_shim_export_the_same_names(launch):
    proc = check(run([sys.executable, "-c", PROBE], env=launch.env("shim"), timeout=240))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["shim_bound"] and out["same_rule"]
    assert out["impl"] == "polytrain"
    if "real" in out:
        assert out["real"] == out["shim"] and out["real_bound"]
