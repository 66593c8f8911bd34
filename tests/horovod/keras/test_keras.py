"""Keras 3 model.fit with polytrain.horovod.keras on real ranks (see worker_keras.py)."""

from __future__ import annotations

import numpy as np
import pytest


def warmup_lr(epoch: int, batch: int, steps: int, size: int, initial: float = 0.1, epochs: int = 2) -> float:
    """Horovod's LearningRateWarmupCallback: lr/size → lr over ``epochs``, adjusted before every batch."""
    return initial / size * ((epoch + (batch + 1) / steps) * (size - 1) / epochs + 1)


def check_keras(per_rank: list[dict]) -> None:
    n = len(per_rank)
    steps = per_rank[0]["steps"]
    for part in ("fit", "accumulate", "warmup"):
        first = np.asarray(per_rank[0][part]["weights"])
        for res in per_rank:
            weights = np.asarray(res[part]["weights"])
            assert np.array_equal(weights, first), f"{part}: rank {res['rank']} has different weights"
            assert np.abs(weights - np.asarray(res[part]["reference"])).max() < 1e-5, \
                f"{part}: distributed fit must equal the single-process fit on the union batches"
    for part in ("fit", "accumulate"):
        # every pass counts as an iteration, also the accumulating ones (Horovod's rule)
        assert all(res[part]["iterations"] == 3 * steps for res in per_rank)
        # MetricAverageCallback: every rank logs the mean of the ranks' own epoch losses
        raw = np.array([[epoch["loss"] for epoch in res[part]["raw"]] for res in per_rank])
        logged = np.array([res[part]["history"]["loss"] for res in per_rank])
        assert np.array_equal(logged, np.repeat(logged[:1], n, axis=0))
        np.testing.assert_allclose(logged[0], raw.mean(axis=0), rtol=1e-6)
        assert np.ptp(raw[:, 0]) > 1e-4  # the ranks' own losses differ, so averaging did something
        np.testing.assert_allclose(per_rank[0][part]["history"]["accuracy"],
                                   np.mean([[e["accuracy"] for e in res[part]["raw"]] for res in per_rank], axis=0),
                                   rtol=1e-6)
    want = [warmup_lr(e, b, steps, n) if e < 2 else 0.1 for e in range(3) for b in range(steps)]
    for res in per_rank:
        np.testing.assert_allclose(res["warmup"]["lrs"], want, rtol=1e-6)
        np.testing.assert_allclose(res["warmup"]["epoch_lr"], [want[steps - 1], 0.1, 0.1], rtol=1e-6)
        reload = res["reload"]
        assert (reload["optimizer"], reload["inner"]) == ("DistributedOptimizer", "Adam")
        assert reload["same_weights"] and reload["same_state"]
        assert reload["after"] == per_rank[0]["reload"]["after"]  # training after reload stays in sync


@pytest.mark.multiproc
@pytest.mark.timeout(500)
# three ranks, the uneven case; the same worker at two runs on real Horovod below and in the shim's examples
@pytest.mark.parametrize("nproc", [3])
def test_keras_fit_under_mpirun_shim(launch, tmp_path, nproc):
    proc = launch.mpirun(nproc, launch.here / "worker_keras.py", str(tmp_path), impl="shim", timeout=450)
    per_rank = launch.results(proc, nproc)
    assert all(res["impl"] == "polytrain" for res in per_rank)
    check_keras(per_rank)


@pytest.mark.multiproc
@pytest.mark.timeout(500)
def test_keras_fit_on_real_horovod_collectives(launch, tmp_path, real_horovod):
    proc = launch.mpirun(2, launch.here / "worker_keras.py", str(tmp_path), impl="horovod", timeout=450)
    per_rank = launch.results(proc, 2)
    assert all(res["impl"] == "horovod" for res in per_rank)
    check_keras(per_rank)
