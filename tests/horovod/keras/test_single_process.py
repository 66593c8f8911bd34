"""One process without a launcher: layout, one-rank training, serialization and the one-line errors."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(300)
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
