"""PyTorch and TensorFlow train alike: same spec, same initial weights (PyTorch's, imported as a step-0
checkpoint that the TensorFlow run resumes from), same batches → per-step training loss within 1e-4
relative over ≥ 50 steps, with SGD and with Adam; on one process and on 2 ranks of a distributed
backend of each framework. Both runs are the real `Trainer` (tf_workers.py ``parity``), so the curves
are the losses it logs; every rank sees the same curve and ends with the same weights.
A model saved by one framework evaluates to the same accuracy in the other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, check, loopback_env, run, step_losses

pytest.importorskip("tensorflow")
pytest.importorskip("torch")

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = str(Path(__file__).resolve().parent / "tf_workers.py")
STEPS = 60
MLP = {"model": {"name": "mlp", "params": {"hidden_sizes": [128, 64]}}, "data": {"batch_size": 32},
       "schedule": {"lr_scaling": "none", "warmup_epochs": 0.5, "decay": "cosine"}, "loop": {"epochs": 5}}
RUNS = {
    "sgd": {**MLP, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
    "adam": {**MLP, "optimizer": {"name": "adam", "lr": 0.003, "weight_decay": 0.001},
             "loop": {"epochs": 5, "grad_clip_norm": 1.0}},
}
LOCAL_RUNS = {
    **RUNS,
    "convnet-nesterov-accum": {"model": {"name": "convnet", "params": {"activation": "gelu"}},
                               "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True,
                                             "weight_decay": 0.0005},
                               "loop": {"epochs": 5, "grad_accum_steps": 2}},
    "adamw": {**MLP, "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.05}},
}


def tf_env() -> dict[str, str]:
    return loopback_env(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")


def assert_parity(out: Path, labels: list[str], backends: dict[str, str], world_size: int, launcher: str) -> None:
    for label in labels:
        ranks = [json.loads((out / label / f"rank{r}.json").read_text()) for r in range(world_size)]
        assert all(seen == ranks[0] for seen in ranks), f"{label}: the ranks saw different starts or losses"
        seen = ranks[0]
        assert (seen["world_size"], seen["launcher"]) == (world_size, launcher)
        assert seen["torch"]["start_digest"] == seen["tensorflow"]["start_digest"], (
            f"{label}: TensorFlow did not start from PyTorch's weights")
        torch_curve, tf_curve = (np.array(seen[k]["losses"]) for k in ("torch", "tensorflow"))
        assert len(torch_curve) == len(tf_curve) == STEPS
        np.testing.assert_allclose(tf_curve, torch_curve, rtol=1e-4, err_msg=label)
        assert torch_curve[-1] < 0.8 * torch_curve[0], f"{label}: did not learn"
        for framework, curve in (("torch", torch_curve), ("tensorflow", tf_curve)):
            run_dir = out / label / framework
            manifest = json.loads((run_dir / "model.json").read_text())
            assert (manifest["framework"], manifest["backend"]) == (framework, backends[framework])
            assert manifest["world_size"] == world_size and manifest["global_step"] == STEPS
            assert len(set(manifest["rank_state_digests"])) == 1, f"{label}/{framework}: ranks' weights differ"
            np.testing.assert_array_equal(step_losses(run_dir), curve, err_msg=f"{label}/{framework}: metrics.jsonl")


def parity(cmd_prefix: list[str], runs: dict, torch_backend: str, tf_backend: str, out: Path) -> None:
    check(run([*cmd_prefix, "parity", json.dumps(runs), torch_backend, tf_backend, str(STEPS), str(out)],
              env=tf_env(), timeout=550))


def test_one_process_parity_and_model_exchange(tmp_path: Path) -> None:
    parity([sys.executable, WORKER], LOCAL_RUNS, "local", "local", tmp_path)
    assert_parity(tmp_path, list(LOCAL_RUNS), {"torch": "local", "tensorflow": "local"}, 1, "single")

    check(run([sys.executable, WORKER, "exchange", str(tmp_path)], env=tf_env(), timeout=400))
    exchange = json.loads((tmp_path / "exchange.json").read_text())
    for trained, row in exchange.items():
        assert row["trained_accuracy"] >= 0.9, (trained, row)
        assert row["other_accuracy"] == pytest.approx(row["trained_accuracy"], abs=1e-9), (trained, row)
        assert row["round_trip_identical"], trained


def test_two_ranks_under_mpirun_torch_mpi_and_tf_mpi(tmp_path: Path) -> None:
    prefix = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", sys.executable, WORKER]
    parity(prefix, RUNS, "mpi", "mpi", tmp_path)
    assert_parity(tmp_path, list(RUNS), {"torch": "mpi", "tensorflow": "mpi"}, 2, "openmpi")


def test_two_ranks_under_local_launcher_ddp_and_tf_multiworker(tmp_path: Path) -> None:
    prefix = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "2", WORKER]
    for label, raw in RUNS.items():  # tf-multiworker joins its cluster once per process: one launch per run
        parity(prefix, {label: raw}, "ddp", "tf-multiworker", tmp_path)
    assert_parity(tmp_path, list(RUNS), {"torch": "ddp", "tensorflow": "tf-multiworker"}, 2, "polytrain-local")
