"""PyTorch and TensorFlow train alike: same spec, same initial weights (exported from PyTorch, imported
into TensorFlow), same batches → per-step training loss within 1e-4 relative over ≥ 50 steps, with
SGD and with Adam; on one process and on 2 ranks of a distributed backend of each framework.
A model saved by one framework evaluates to the same accuracy in the other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, check, loopback_env, run

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


def assert_parity(results: dict, labels: list[str]) -> None:
    for label in labels:
        run_result = results[label]
        assert run_result["same_start"], f"{label}: TensorFlow did not start from PyTorch's weights"
        torch_curve, tf_curve = (np.array(run_result["curves"][k]) for k in ("torch", "tensorflow"))
        assert len(torch_curve) == len(tf_curve) == STEPS
        np.testing.assert_allclose(tf_curve, torch_curve, rtol=1e-4, err_msg=label)
        assert torch_curve[-1] < 0.8 * torch_curve[0], f"{label}: did not learn"


def parity(cmd_prefix: list[str], runs: dict, torch_backend: str, tf_backend: str, out: Path) -> dict:
    result_file = out / "parity.json"
    check(run([*cmd_prefix, "parity", json.dumps(runs), torch_backend, tf_backend, str(STEPS), str(result_file)],
              env=tf_env(), timeout=550))
    return json.loads(result_file.read_text())


def test_one_process_parity_and_model_exchange(tmp_path: Path) -> None:
    results = parity([sys.executable, WORKER], LOCAL_RUNS, "local", "local", tmp_path)
    assert results["backends"] == {"torch": "local", "tensorflow": "local"}
    assert_parity(results, list(LOCAL_RUNS))

    check(run([sys.executable, WORKER, "exchange", str(tmp_path)], env=tf_env(), timeout=400))
    exchange = json.loads((tmp_path / "exchange.json").read_text())
    for trained, row in exchange.items():
        assert row["trained_accuracy"] >= 0.9, (trained, row)
        assert row["other_accuracy"] == pytest.approx(row["trained_accuracy"], abs=1e-9), (trained, row)
        assert row["round_trip_identical"], trained


def test_two_ranks_under_mpirun_torch_mpi_and_tf_mpi(tmp_path: Path) -> None:
    prefix = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", sys.executable, WORKER]
    results = parity(prefix, RUNS, "mpi", "mpi", tmp_path)
    assert results["world_size"] == 2 and results["launcher"] == "openmpi"
    assert_parity(results, list(RUNS))


def test_two_ranks_under_local_launcher_ddp_and_tf_multiworker(tmp_path: Path) -> None:
    prefix = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "2", WORKER]
    results = parity(prefix, RUNS, "ddp", "tf-multiworker", tmp_path)
    assert results["world_size"] == 2 and results["launcher"] == "polytrain-local"
    assert_parity(results, list(RUNS))
