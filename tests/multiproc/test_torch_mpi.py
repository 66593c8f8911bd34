"""PyTorch on backend ``mpi`` (gradients averaged through mpi4py, no process group) under mpirun:
2 ranks × b trains exactly like 1 process × 2b, and the ranks end bit-identical."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, check, loopback_env, run

from polytrain.checkpoint import read_model

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

COMMON = ["framework=torch", "optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9",
          "schedule.lr_scaling=none", "loop.epochs=5", "loop.log_every_n_steps=1"]


def train(cmd_prefix: list[str], out: Path, batch: int, backend: str) -> tuple[np.ndarray, dict, dict]:
    sets = [*COMMON, f"backend={backend}", f"data.batch_size={batch}", f"output={out}"]
    cmd = [*cmd_prefix, sys.executable, "-m", "polytrain.cli", "train", *[a for s in sets for a in ("--set", s)]]
    # 4 KiB buckets: the larger weights are reduced alone, the biases fused
    check(run(cmd, env=loopback_env(POLYTRAIN_MPI_FUSION_BYTES="4096"), timeout=250))
    events = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    state, manifest = read_model(out)
    return np.array([e["loss"] for e in events if e["event"] == "step"]), state, manifest


def test_two_mpi_ranks_equal_one_process_with_double_batch(tmp_path: Path) -> None:
    mpirun = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", "-x", "POLYTRAIN_MPI_FUSION_BYTES"]
    losses, state, manifest = train(mpirun, tmp_path / "mpi", 32, "mpi")
    ref_losses, ref_state, _ = train([], tmp_path / "single", 64, "local")
    assert manifest["backend"] == "mpi" and manifest["world_size"] == 2
    assert len(set(manifest["rank_state_digests"])) == 1
    assert manifest["val_accuracy"] >= 0.95
    assert len(losses) == len(ref_losses) == 115
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-5 * float(np.abs(value).max()), err_msg=name)
