"""One process without a launcher: layout, one-rank training, serialization and the one-line errors."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_surface_in_one_process(launch, tmp_path):
    proc = launch.single(launch.here / "worker_single.py", str(tmp_path), impl="shim", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (res,) = launch.results(proc, 1)
    assert res["before_init"][:2] == ["ValueError", "Horovod has not been initialized; use hvd.init()."]
    # polytrain.horovod.tensorflow.keras is polytrain.horovod.keras; hvd_tf.DistributedOptimizer wraps Keras
    assert res["layout"] == [True, True, True, "DistributedOptimizer"]
    wrapped, plain = res["one_process_fit"]
    assert wrapped == plain  # on one rank the wrapper changes nothing
    assert res["config"] == ["Adam", pytest.approx(0.02), 2, "DistributedOptimizer"]
    assert res["min_op_error"] == ["HorovodArgumentError", "op currently only supports Average and Sum", "True"]
    assert res["tf1_error"][0] == "HorovodUnsupportedError" and res["tf1_error"][2] == "True"
    assert res["xla_error"][0] == "BackendUnavailableError"
    assert "polytrain's MPI collectives cannot run inside XLA; compile with jit_compile=False" in res["xla_error"][1]
    assert res["process_set_error"][0] == "HorovodUnsupportedError"
    assert res["reload_plain"] == ["DistributedOptimizer", "Adam", True, 2]  # 1 step before saving, 1 after


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_util_and_compute_gradients_as_horovods_tests_call_them(launch):
    """Issue 36 item 6: ``horovod.tensorflow.util`` and the Keras optimizers' ``_compute_gradients`` (see
    worker_compute_gradients.py; the expected numbers are those of Horovod's test_tensorflow2_keras.py)."""
    proc = launch.single(launch.here / "worker_compute_gradients.py", impl="shim", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (res,) = launch.results(proc, 1)
    assert res["util"] == {"module": True, "eager": True, "graph": False, "calls": [True, False], "subgraph": 6.0,
                           "traced_kind": True, "refs": [True, True, True], "back": [True, True, True]}
    for average, res_avg in res["aggregation"].items():
        passes = 1 if average == "True" else 4  # the sum of 4 passes, or their mean
        for idx, (x, y0, y1, iterations) in enumerate(res_avg["trace"]):
            steps = (idx + 1) // 4
            assert (x, y0, y1, iterations) == (steps * passes, 1.0 - steps * passes, 2.0, idx + 1)
        assert res_avg["counter"] == 10 % 4
    inf = res["inf"]
    assert inf["grads"][1:] == [1.0, 1.0, 1.0] and inf["finite"] and inf["sums"] == [0.0]
    assert inf["x"] == float("-inf")  # the first cycle's inf was applied, then the sums restarted from zero
    for case in res["partial"].values():
        assert all(case["local"]) and all(case["shared"]) and len(case["local"]) + len(case["shared"]) == 4
    once = res["once"]
    assert once["grad"] == [2.0, 4.0] and once["w"] == [-0.5, -0.5]
    assert once["reduced"] == [[1], [1, 1]]  # reduced in _compute_gradients, not again by apply_gradients
    assert once["missing_tape"] == ["HorovodArgumentError", "`tape` is required when a `Tensor` loss is passed."]
