"""Keras 3 local variables, PartialDistributedOptimizer and aggregation with non-finite gradients, on 2 real ranks.

See worker_local_vars.py. Horovod 0.28.1 itself fails the local-variable cases on Keras 3
(``'Variable' object has no attribute 'ref'``); the expected numbers are Horovod's semantics.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

NPROC = 2


def by_layer(weights: dict[str, list[float]]) -> dict[str, list[float]]:
    """``{"sequential_3/mine/kernel": v}`` → ``{"mine/kernel": v}`` (the model's own name differs per case)."""
    return {name.split("/", 1)[1]: value for name, value in weights.items()}


def check_broadcast_with_local_variables(per_rank: list[dict]) -> None:
    root = NPROC - 1
    for res in per_rank:
        r = res["rank"]
        cb = by_layer(res["callback"]["weights"])
        assert res["callback"]["done"]
        # the local (non-trainable) layer keeps this rank's values; everything else is the root's
        assert cb["local/kernel"] == [float(r)] * 9 and cb["local/bias"] == [float(r)] * 3
        assert cb["out/kernel"] == [float(root)] * 9 and cb["out/bias"] == [float(root)] * 3
        assert cb["bn/moving_mean"] == [float(root)] * 3  # non-trainable weights are broadcast too
        assert res["callback"]["optimizer"] == per_rank[root]["callback"]["optimizer"]
        # through model.fit, the local variables registered as the tf.Variables inside the Keras variables
        fit = by_layer(res["fit"]["weights"])
        assert fit["local/kernel"] == [float(r)] * 9, "a local variable given as its tf.Variable was overwritten"
        assert fit["out/kernel"] == [float(root)] * 9 and fit["out/bias"] == [float(root)] * 3


def check_broadcast_variables(per_rank: list[dict]) -> None:
    root = per_rank[NPROC - 1]["broadcast_variables"]
    before = [res["broadcast_variables"]["before"] for res in per_rank]
    assert before[0] != before[1]  # the ranks started apart, the seed-generator state included
    for res in per_rank:
        bv = res["broadcast_variables"]
        assert bv["eager"] == {**root["before"], "plain": [float(NPROC - 1)] * 2}
        # in a tf.function, from rank 0: rank 0's plain variable (0 * 10) and its kernel (already the root's)
        assert bv["graph"] == [[0.0, 0.0], [float(NPROC - 1)] * 9]


def check_partial(per_rank: list[dict]) -> None:
    mean = sum(r + 1 for r in range(NPROC)) / NPROC
    for res in per_rank:
        r, part = res["rank"], res["partial"]
        # local layer: own gradient / size (scale_local_gradients); shared layer: the average; lr = 1
        assert all(v == -(r + 1) / NPROC for values in part["mine"].values() for v in values)
        assert all(v == -mean for values in part["shared"].values() for v in values)
        assert part["error"] == ["HorovodArgumentError", "All local layers must be of tf.keras.layers.Layer type."]
    mine = [by_layer(res["partial"]["mine"]) for res in per_rank]
    shared = [by_layer(res["partial"]["shared"]) for res in per_rank]
    assert mine[0] != mine[1] and shared[0] == shared[1]


def check_computed(per_rank: list[dict]) -> None:
    """_compute_gradients returns the reduced gradients (local: own / size), and apply_gradients applies them as
    they are: reduced again, the local layer's step would be divided by the size twice."""
    mean = sum(r + 1 for r in range(NPROC)) / NPROC
    for res in per_rank:
        r, computed = res["rank"], res["computed"]
        grads = by_layer(computed["grads"])
        assert all(v == (r + 1) / NPROC for name, values in grads.items() if name.startswith("mine/") for v in values)
        assert all(v == mean for name, values in grads.items() if name.startswith("shared/") for v in values)
        for layer in ("mine", "shared"):  # the same step as apply's own reduction
            assert by_layer(computed[layer]) == by_layer(res["partial"][layer])


def check_aggregation(per_rank: list[dict]) -> None:
    """backward_passes_per_step=2; x gets inf on the last rank in pass 1, z nan on rank 0 in pass 2."""
    for res in per_rank:
        trace = res["aggregation"]["trace"]
        # pass 1 only accumulates; the last rank's sum for x holds the inf
        assert (trace[0]["x"], trace[0]["y"]) == (0.0, 0.0)
        assert trace[0]["sums"][1] == ([math.inf] if res["rank"] == NPROC - 1 else [1.0])
        # pass 2 reduces and applies: the inf and the nan reach every rank's update; y is untouched by them
        assert trace[1]["x"] == -math.inf and math.isnan(trace[1]["z"]) and trace[1]["y"] == -2.0
        # the sums restart from exact zeros, so the next cycle is finite again
        assert trace[1]["sums"] == [[0.0]] * 4 and trace[2]["sums"] == [[1.0]] * 4
        assert trace[3]["y"] == -4.0
        assert res["aggregation"]["iterations"] == 4  # every pass counts (Horovod)

        scaled = res["aggregation_loss_scale"]["trace"]
        # a LossScaleOptimizer inside sees the reduced inf on every rank: the step is skipped everywhere
        assert [(t["x"], t["y"], t["z"]) for t in scaled[:3]] == [(0.0, 0.0, 0.0)] * 3
        assert [t["scale"] for t in scaled] == [4.0, 2.0, 2.0, 2.0]
        # next cycle: sum 2 over the passes, averaged over ranks, unscaled by 2 -> a step of 1
        assert (scaled[3]["x"], scaled[3]["y"], scaled[3]["z"]) == (-1.0, -1.0, -1.0)
        assert scaled[1]["sums"] == [[0.0]] * 4
    for part in ("aggregation", "aggregation_loss_scale"):
        traces = [np.array([[t["x"], t["y"], t["z"]] for t in res[part]["trace"]]) for res in per_rank]
        np.testing.assert_array_equal(traces[0], traces[1])  # the ranks stay identical, nan and inf included


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_local_variables_partial_optimizer_and_nonfinite_aggregation(launch):
    proc = launch.mpirun(NPROC, launch.here / "worker_local_vars.py", impl="shim", timeout=360)
    per_rank = launch.results(proc, NPROC)
    assert all(res["impl"] == "polytrain" for res in per_rank)
    check_broadcast_with_local_variables(per_rank)
    check_broadcast_variables(per_rank)
    check_partial(per_rank)
    check_computed(per_rank)
    check_aggregation(per_rank)
