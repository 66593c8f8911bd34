"""PyTorch on backend ``mpi`` (gradients averaged through mpi4py, no process group) under mpirun:
2 ranks × b trains exactly like 1 process × 2b, and the ranks end bit-identical."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from procs import trained_run

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

COMMON = ["framework=torch", "optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9",
          "schedule.lr_scaling=none", "loop.epochs=5", "loop.log_every_n_steps=1"]


def trained(launcher: str, out: Path, batch: int, backend: str) -> tuple[np.ndarray, dict, dict]:
    """One process (``python``) or 2 ranks under ``mpirun``."""
    sets = [*COMMON, f"backend={backend}", f"data.batch_size={batch}"]
    # 4 KiB buckets: the larger weights are reduced alone, the biases fused
    run = trained_run(out, sets, launcher=launcher, nproc=2 if launcher == "mpirun" else 1, quiet=False,
                      env={"POLYTRAIN_MPI_FUSION_BYTES": "4096"}, exports=["POLYTRAIN_MPI_FUSION_BYTES"], timeout=250)
    return run.losses, run.state, run.manifest


def test_two_mpi_ranks_equal_one_process_with_double_batch(tmp_path: Path) -> None:
    losses, state, manifest = trained("mpirun", tmp_path / "mpi", 32, "mpi")
    ref_losses, ref_state, ref_manifest = trained("python", tmp_path / "single", 64, "local")
    assert manifest["backend"] == "mpi" and manifest["world_size"] == 2
    assert len(set(manifest["rank_state_digests"])) == 1
    # the one process's accuracy, within a digit or two (weights within rounding), not a fixed number: 0.955
    # here, 0.005 above the 0.95 this once asserted
    assert abs(manifest["val_accuracy"] - ref_manifest["val_accuracy"]) <= 2 / 359 and ref_losses[-1] < ref_losses[0] / 2
    assert len(losses) == len(ref_losses) == 115
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-5 * float(np.abs(value).max()), err_msg=name)
